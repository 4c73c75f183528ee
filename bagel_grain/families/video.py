"""Video for VLM rows: upstream's frame sampler (`rand`, `middle`, `fpsX`) on frame folders and
video files, and the decoding of only the frames a sample uses.

The rules (docs/design.md, section 10): a sample first draws a frame count `t` between
`min_num_frames` and `max_num_frames`, whatever the mode; `frame_indices` turns `t` and
the video's length into frame positions. A video file is indexed by demuxing its packets
(no decoding), as decord does when it opens a file: its length is its number of video
packets and frame `i` is the `i`-th in presentation order. Then only the wanted frames
are decoded, each reached from the nearest keyframe before it when that is cheaper than
decoding on; the frames equal a decode from the start bit for bit.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import io
import math
import re
from typing import IO, Any, Callable, Iterator, Sequence

import numpy as np

from bagel_grain.drops import Drop, DropReason, require
from bagel_grain.families.video_headers import jpeg_size, mp4_claims
from bagel_grain.ranged_file import RangedFile

DEFAULT_MAX_VIDEO_BYTES = 1 << 30  # a larger video file is never opened
# Frames decoded for one video sample, counting those decoded only to reach a wanted one.
DEFAULT_MAX_VIDEO_FRAMES = 4096
# The demuxers a video file may be read with (ffmpeg names): the containers tested.
# Anything else (playlists, image sequences, concat lists, raw streams) is refused before
# it is parsed, so no record can make ffmpeg open another file or a network address.
ALLOWED_DEMUXERS = "mov,mp4,matroska,webm,avi"
# Streams a container may hold: a record uses one video stream (audio and subtitles may sit
# beside it). FFmpeg stops parsing the header at the next one, before probing any.
MAX_STREAMS = 16
# The packets a video stream may hold, per frame of `max_video_frames`: its index (every
# packet's timestamp) is built before sampling, so its cost is bounded by this, not by the
# file (16 x 4096 by default: 36 minutes at 30 fps). The packets of all streams together
# may be `ALL_STREAMS` times as many (audio beside video: AAC at 48 kHz is 47 a second).
PACKETS_PER_FRAME = 16
ALL_STREAMS = 2
# Upstream's frame number of a folder entry: the digits before `.jpg` (any character
# before `jpg`, as upstream's pattern writes it); entries without one sort first, as -1.
_FRAME_NUMBER = re.compile(r"_(\d+).jpg$")
_MODES = ("rand", "middle")
_FFMPEG_MAX_PIXELS = 2**31 - 1  # FFmpeg's own bound on a frame (an int option)


def check_sample_mode(sample: Any) -> str:
  """`sample` if it is upstream's `rand`, `middle` or `fpsX` (X > 0), else ValueError."""
  if sample in _MODES:
    return sample
  if isinstance(sample, str) and sample.startswith("fps"):
    try:
      fps = float(sample[3:])
    except ValueError:
      fps = math.nan
    if math.isfinite(fps) and fps > 0:
      return sample
  raise ValueError(f"`sample` must be 'rand', 'middle' or 'fpsX' with X > 0 (e.g. fps0.5), "
                   f"got {sample!r}")


@dataclasses.dataclass(frozen=True)
class FrameSamplerArgs:
  """Upstream's `frame_sampler_args`: how many frames a video sample takes, and which."""

  max_num_frames: int = 12
  min_num_frames: int = 8
  sample: str = "rand"

  def __post_init__(self):
    check_sample_mode(self.sample)

  @property
  def output_fps(self) -> float | None:
    """X of an `fpsX` mode; None for `rand` and `middle`."""
    return float(self.sample[3:]) if self.sample.startswith("fps") else None


def draw_frame_count(args: FrameSamplerArgs, rng: np.random.Generator) -> int:
  """Upstream's first draw, made in every mode: `t` in [min_num_frames, max_num_frames]."""
  return int(rng.integers(args.min_num_frames, args.max_num_frames + 1))


def _fps_times(vlen: int, input_fps: float, output_fps: float, max_frames: int) -> np.ndarray:
  """Upstream's `fpsX` sampling times, refused before allocating when there are too many."""
  duration = float(vlen) / input_fps
  delta = 1 / output_fps
  start, stop = 0 + delta / 2, duration + delta / 2
  count = max(0, math.ceil((stop - start) / delta))  # what np.arange would allocate
  require(count <= max_frames, DropReason.TOO_MANY_VIDEO_FRAMES,
          f"fps{output_fps:g} of {vlen} frames at {input_fps:g} fps gives {count} "
          f"frames, more than max_video_frames = {max_frames}")
  return np.arange(start, stop, delta)


def frame_indices(t: int, vlen: int, args: FrameSamplerArgs, rng: np.random.Generator, *,
                  input_fps: float = 1.0, max_frames: int = DEFAULT_MAX_VIDEO_FRAMES) -> list[int]:
  """Upstream's index rule: which of `vlen` frames a sample of `t` frames takes.

  `rand` / `middle`: `n = min(t, vlen)` equal intervals `[a_i, a_{i+1})` of
  `linspace(0, vlen, n + 1)`; `rand` draws from `range(a_i, a_{i+1} - 1)` (its last
  frame never drawn; one empty range sends the whole draw to a sorted random
  permutation), `middle` takes `(a_i + a_{i+1} - 1) // 2`; padded to `t` with the last.
  `fpsX`: one frame every `1/X` s, at the middle of each step, of those before `vlen`;
  not padded. `input_fps` is the video's frame rate (1 for a folder).
  """
  output_fps = args.output_fps
  if output_fps is not None:
    require(math.isfinite(input_fps) and input_fps > 0, DropReason.VIDEO_UNREADABLE,
            f"the video has no usable frame rate ({input_fps}) for {args.sample}")
    times = _fps_times(vlen, input_fps, output_fps, max_frames)
    return [int(i) for i in np.around(times * input_fps).astype(int) if i < vlen]
  require(vlen >= 1, DropReason.VIDEO_UNREADABLE, "the video has no frames")
  kept = min(t, vlen)
  bounds = np.linspace(0, vlen, kept + 1).astype(int)
  lows, highs = bounds[:-1], bounds[1:] - 1
  if args.sample == "middle":
    indices = [int(lo + hi) // 2 for lo, hi in zip(lows, highs)]
  elif np.all(highs > lows):
    indices = [int(rng.integers(lo, hi)) for lo, hi in zip(lows, highs)]
  else:
    indices = sorted(int(i) for i in rng.permutation(vlen)[:kept])
  return indices + [indices[-1]] * (t - len(indices))


# --- frame folders ----------------------------------------------------------------------


def frame_number(name: str) -> int:
  """The number upstream sorts a folder entry by: N of `*_N.jpg`, else -1."""
  match = _FRAME_NUMBER.search(name)
  return int(match.group(1)) if match else -1


def order_folder_entries(paths: Sequence[str]) -> list[str]:
  """Every entry of a frame folder in upstream's order: by `frame_number` of the base name.

  Entries with the same number (all those without one) keep name order, where upstream
  keeps the order the file system lists them in.
  """
  names = sorted(paths, key=lambda p: p.rstrip("/").rsplit("/", 1)[-1])
  return sorted(names, key=lambda p: frame_number(p.rstrip("/").rsplit("/", 1)[-1]))


def sample_folder(entries: Sequence[str], args: FrameSamplerArgs, rng: np.random.Generator, *,
                  max_frames: int = DEFAULT_MAX_VIDEO_FRAMES) -> list[str]:
  """The entries a sample takes: `frame_indices` when there are more than `t`, else all.

  A folder is not padded: one of 3 entries gives 3 frames, an empty one none.
  """
  t = draw_frame_count(args, rng)
  if len(entries) <= t:
    return list(entries)
  return [entries[i] for i in frame_indices(t, len(entries), args, rng, max_frames=max_frames)]


# --- video files ------------------------------------------------------------------------


def _pyav():
  """PyAV, imported on first use: only rows with a video file need it."""
  try:
    import av  # pylint: disable=import-outside-toplevel
  except ImportError:  # a plain dependency; only a broken install lacks it
    raise Drop(DropReason.VIDEO_UNREADABLE, "video files need PyAV (`pip install av`)") from None
  return av


def _decode_errors(av) -> tuple[type[BaseException], ...]:
  return (av.FFmpegError, OSError, ValueError, EOFError, IndexError, MemoryError)


@dataclasses.dataclass(frozen=True)
class VideoIndex:
  """A video stream as its packets describe it: what decord indexes when it opens a file.

  `pts`: every frame's timestamp in presentation order (frame `i` is `pts[i]`);
  `keys`: positions (in that order) of the keyframes; `fps`: the stream's average rate.
  """

  pts: tuple[int, ...]
  keys: tuple[int, ...]
  fps: float

  def __len__(self) -> int:
    return len(self.pts)


def max_packets(max_frames: int) -> int:
  """The packets a video stream may hold (see `PACKETS_PER_FRAME`)."""
  return PACKETS_PER_FRAME * max_frames


def _too_many_packets(what: str, count: int, bound: int, max_frames: int) -> Drop:
  return Drop(DropReason.TOO_MANY_VIDEO_FRAMES,
              f"{what} {count} packets, over the bound of {bound} ({bound // max_frames} x "
              f"max_video_frames = {max_frames}); raise max_video_frames to read longer videos")


def index_stream(container, stream, max_frames: int = DEFAULT_MAX_VIDEO_FRAMES) -> VideoIndex:
  """Demuxes (never decodes) the packets of `stream`, at most `max_packets(max_frames)` of
  them (and `ALL_STREAMS` times that of all streams); drops a container whose headers claim another
  frame count or a duration its packets do not fill."""
  pts, key_pts, last_duration = [], [], 0
  bound, demuxed = max_packets(max_frames), 0
  for packet in container.demux():
    demuxed += 1
    if demuxed > ALL_STREAMS * bound:
      raise _too_many_packets("the container holds more than", ALL_STREAMS * bound,
                              ALL_STREAMS * bound, max_frames)
    if packet.stream_index != stream.index or (packet.size == 0 and packet.pts is None):
      continue  # another stream's, or PyAV's end-of-stream marker, not a frame
    if len(pts) == bound:
      raise _too_many_packets("the video stream holds more than", bound, bound, max_frames)
    require(packet.pts is not None, DropReason.VIDEO_UNREADABLE,
            "a video packet has no timestamp; frames cannot be addressed")
    pts.append(packet.pts)
    last_duration = packet.duration or 0
    if packet.is_keyframe:
      key_pts.append(packet.pts)
  order = sorted(pts)
  require(len(set(order)) == len(order), DropReason.VIDEO_UNREADABLE,
          "two video packets share a timestamp")
  claimed = stream.frames
  require(not claimed or claimed == len(order), DropReason.VIDEO_UNREADABLE,
          f"the container claims {claimed} frames but holds {len(order)}")
  if order and stream.duration and stream.time_base:
    span = float((order[-1] - order[0] + last_duration) * stream.time_base)
    said = float(stream.duration * stream.time_base)
    require(said <= 2 * span + 1 and span <= 2 * said + 1, DropReason.VIDEO_UNREADABLE,
            f"the container claims {said:.3g} s but its frames span {span:.3g} s")
  rate = stream.average_rate
  fps = float(rate.numerator) / rate.denominator if rate else math.nan  # decord's avg fps
  position = {p: i for i, p in enumerate(order)}
  return VideoIndex(tuple(order), tuple(sorted(position[p] for p in key_pts)), fps)


@dataclasses.dataclass(frozen=True)
class DecodeRun:
  """Decode from the keyframe at position `start` (None: go on from where decoding is)
  until the frame at position `stop`."""

  start: int | None
  stop: int


def plan_decoding(index: VideoIndex, wanted: Sequence[int]) -> tuple[list[DecodeRun], int]:
  """Runs that decode the `wanted` positions, and the frames they decode.

  Each wanted frame (in order) is reached by decoding on from the previous one, unless
  a keyframe lies between them: then decoding restarts at that keyframe (the nearest
  before the frame), which decodes fewer frames.
  """
  runs, cost, position = [], 0, None  # position: the next frame decoding on would give
  for w in sorted(set(wanted)):
    i = bisect.bisect_right(index.keys, w) - 1
    key = index.keys[i] if i >= 0 else 0  # no keyframe before: only the start can reach it
    if position is not None and key <= position <= w:
      runs.append(DecodeRun(None, w))
      cost += w - position + 1
    else:
      runs.append(DecodeRun(key, w))
      cost += w - key + 1
    position = w + 1
  return runs, cost


def _decoded(container, stream, max_pixels: int) -> Iterator:
  """The stream's frames from the container's current position, in presentation order.

  An MJPEG packet is a whole JPEG that may give any frame size, whatever the header
  said: its own frame header is checked before the decoder sees it. For other codecs
  FFmpeg refuses a frame over `max_pixels` before allocating it (set in `_OpenVideo`).
  """
  mjpeg = stream.codec_context.name == "mjpeg"
  for packet in container.demux(stream):
    if mjpeg and packet.size:
      size = jpeg_size(memoryview(packet))
      require(size is None or size[0] * size[1] <= max_pixels, DropReason.TOO_MANY_PIXELS,
              f"a frame's JPEG header says {size[0]}x{size[1]} > {max_pixels} pixels"
              if size else "")
    yield from packet.decode()


class _Decoder:
  """Carries out a plan: seeks, decodes, keeps the wanted frames as RGB PIL images."""

  def __init__(self, container, stream, index: VideoIndex, *, max_frames: int, max_pixels: int):
    self.container, self.stream, self.index = container, stream, index
    self.max_frames, self.max_pixels = max_frames, max_pixels
    self.frames: Iterator | None = None
    self.decoded = 0

  def _seek(self, position: int) -> None:
    self.container.seek(self.index.pts[position], stream=self.stream, backward=True,
                        any_frame=False)
    self.frames = _decoded(self.container, self.stream, self.max_pixels)

  def _next(self):
    frame = next(self.frames, None)
    require(frame is not None, DropReason.VIDEO_UNREADABLE,
            "the stream ended before a frame its packets announce")
    self.decoded += 1
    # The plan was checked against max_frames; this only stops a stream whose seeking
    # does not land where its index says (a damaged or lying file).
    require(self.decoded <= 2 * self.max_frames, DropReason.TOO_MANY_VIDEO_FRAMES,
            f"decoded {self.decoded} frames without reaching the wanted ones")
    require(frame.pts is not None, DropReason.VIDEO_UNREADABLE, "a decoded frame has no timestamp")
    return frame

  def run(self, run: DecodeRun):
    target = self.index.pts[run.stop]
    if run.start is not None:
      self._seek(run.start)
    restarted = run.start == 0
    while True:
      frame = self._next()
      if frame.pts < target:
        continue
      if frame.pts > target and not restarted:
        # Seeking landed after the frame (an index that misplaces keyframes): decode it
        # from the start instead, as a decoder without seeking would.
        self._seek(0)
        restarted = True
        continue
      require(frame.pts == target, DropReason.VIDEO_UNREADABLE,
              f"no frame has timestamp {target}, which a packet announces")
      require(frame.width * frame.height <= self.max_pixels, DropReason.TOO_MANY_PIXELS,
              f"a {frame.width}x{frame.height} frame > {self.max_pixels} pixels")
      return frame.to_image()


def _open(av, source: str | IO[bytes]):
  return av.open(source, "r", container_options={"format_whitelist": ALLOWED_DEMUXERS,
                                                  "max_streams": str(MAX_STREAMS + 1)})


def check_claims(source: str | IO[bytes], max_frames: int) -> None:
  """Drops an MP4/MOV whose sample tables claim more samples than its index may hold (or
  more tracks than `MAX_STREAMS`), from a few small reads, before FFmpeg builds an index
  entry per claimed sample. Other containers claim nothing FFmpeg allocates ahead."""
  with contextlib.ExitStack() as stack:
    f = stack.enter_context(open(source, "rb")) if isinstance(source, str) else source
    size = f.seek(0, io.SEEK_END)
    try:
      claims = mp4_claims(f, size, ALL_STREAMS * max_packets(max_frames))
    finally:
      f.seek(0)
  if claims is None:
    return
  require(len(claims.tracks) <= MAX_STREAMS, DropReason.VIDEO_UNREADABLE,
          f"the MP4 header holds {len(claims.tracks)} tracks, more than {MAX_STREAMS}")
  if claims.fragment_samples > ALL_STREAMS * max_packets(max_frames):
    raise _too_many_packets("the MP4 file's fragments claim", claims.fragment_samples,
                            ALL_STREAMS * max_packets(max_frames), max_frames)
  for track in claims.tracks:
    bound = max_packets(max_frames) * (1 if track.handler == b"vide" else ALL_STREAMS)
    if track.samples > bound:
      kind = {b"vide": "video", b"soun": "audio"}.get(track.handler, "non-video")
      raise _too_many_packets(f"the MP4 header's {kind} track claims", track.samples, bound,
                              max_frames)


class _OpenVideo:
  """A video file opened for sampling: its container, its video stream and their index."""

  def __init__(self, source: str | IO[bytes], max_pixels: int, max_frames: int):
    self.av = _pyav()
    self.errors = _decode_errors(self.av)
    self.source, self.max_pixels, self.max_frames = source, max_pixels, max_frames

  def __enter__(self) -> _OpenVideo:
    try:
      check_claims(self.source, self.max_frames)
      self.container = _open(self.av, self.source)
    except self.errors as e:
      raise Drop(DropReason.VIDEO_UNREADABLE, f"{type(e).__name__}: {e}") from None
    try:
      require(self.container.streams.video, DropReason.VIDEO_UNREADABLE, "no video stream")
      # FFmpeg made at most one stream more than the bound, and probed none of the rest.
      require(len(self.container.streams) <= MAX_STREAMS, DropReason.VIDEO_UNREADABLE,
              f"the container holds more than {MAX_STREAMS} streams")
      self.stream = self.container.streams.best("video")
      # One decoding thread, as upstream's decord reader: a worker process is the unit of
      # parallelism, and FFmpeg's automatic count would start a thread per core in each.
      self.stream.codec_context.thread_count = 1
      if self.max_pixels < _FFMPEG_MAX_PIXELS:  # the decoder refuses a larger frame unmade
        self.stream.codec_context.options = {"max_pixels": str(self.max_pixels)}
      width, height = self.stream.codec_context.width, self.stream.codec_context.height
      require(width * height <= self.max_pixels, DropReason.TOO_MANY_PIXELS,
              f"{width}x{height} frames > {self.max_pixels} pixels")
      self.index = index_stream(self.container, self.stream, self.max_frames)
      require(len(self.index) >= 1, DropReason.VIDEO_UNREADABLE, "the video has no frames")
    except BaseException as e:
      self.__exit__(type(e), e, None)
      if isinstance(e, self.errors):
        raise Drop(DropReason.VIDEO_UNREADABLE, f"{type(e).__name__}: {e}") from None
      raise
    return self

  def __exit__(self, *exc) -> None:
    self.container.close()

  def decode(self, positions: Sequence[int], max_frames: int) -> list:
    """The frames at `positions` (RGB PIL images, one object per distinct position)."""
    runs, cost = plan_decoding(self.index, positions)
    require(cost <= max_frames, DropReason.TOO_MANY_VIDEO_FRAMES,
            f"reaching the {len(runs)} wanted frames decodes {cost} frames (keyframes too far "
            f"apart), more than max_video_frames = {max_frames}")
    decoder = _Decoder(self.container, self.stream, self.index, max_frames=max_frames,
                       max_pixels=self.max_pixels)
    try:
      images = {run.stop: decoder.run(run) for run in runs}
    except self.errors as e:
      raise Drop(DropReason.VIDEO_UNREADABLE, f"{type(e).__name__}: {e}") from None
    return [images[i] for i in positions]


@contextlib.contextmanager
def _failures_of(source: str | IO[bytes]) -> Iterator[None]:
  """Raises the failure a file object met (a storage error, a drop for a vanished object)
  in place of what FFmpeg made of it: PyAV takes an exception in `read` for the end of
  the file, so what followed (a short index, a decoding error) is not the video's fault."""
  if not isinstance(source, RangedFile):
    yield
    return
  try:
    yield
  except BaseException:
    if source.failure is not None:
      raise source.failure from None
    raise
  if source.failure is not None:
    raise source.failure


def read_video_frames(source: str | IO[bytes], args: FrameSamplerArgs,
                      rng: np.random.Generator, *, max_frames: int = DEFAULT_MAX_VIDEO_FRAMES,
                      max_pixels: int = 89_478_485,
                      take: Callable[[int], int] | None = None) -> tuple[list, int]:
  """The first `take(n)` (default all) of the `n` frames a video file gives, as RGB PIL
  images, and `n`.

  Frames are sampled as upstream samples a file (its packets counted, its average
  frame rate for `fpsX`); only those taken are decoded, each one once however often
  it repeats. Bounds, checked before decoding: at most `max_pixels` per frame, at most
  `max_frames` frames sampled or decoded.
  """
  with _failures_of(source), _OpenVideo(source, max_pixels, max_frames) as video:
    t = draw_frame_count(args, rng)
    indices = frame_indices(t, len(video.index), args, rng, input_fps=video.index.fps,
                            max_frames=max_frames)
    require(len(indices) <= max_frames, DropReason.TOO_MANY_VIDEO_FRAMES,
            f"{len(indices)} frames sampled > max_video_frames = {max_frames}")
    used = indices if take is None else indices[:take(len(indices))]
    return video.decode(used, max_frames), len(indices)


def decode_video_frames(source: str | IO[bytes], positions: Sequence[int], *,
                        max_frames: int = DEFAULT_MAX_VIDEO_FRAMES,
                        max_pixels: int = 89_478_485) -> list:
  """The frames at `positions` (presentation order) of a video file, as RGB PIL images."""
  with _failures_of(source), _OpenVideo(source, max_pixels, max_frames) as video:
    require(all(0 <= p < len(video.index) for p in positions), DropReason.VIDEO_UNREADABLE,
            f"positions outside the {len(video.index)} frames")
    return video.decode(positions, max_frames)


def probe_video(source: str | IO[bytes], max_frames: int = DEFAULT_MAX_VIDEO_FRAMES
                ) -> VideoIndex:
  """The index of a video file (its frames, keyframes and rate), or Drop(video_unreadable)."""
  with _failures_of(source), _OpenVideo(source, max_pixels=2**62,
                                        max_frames=max_frames) as video:
    return video.index
