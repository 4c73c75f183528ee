"""`np.random.default_rng([a, b, c, d]).random()` for four numbers under 2**32, in Python.

The main process makes about eight weighted draws a row, each from a generator keyed
by (seed, stream, process, draw number): numpy builds a `SeedSequence`, a `PCG64` and
a `Generator` for one number, 20-40 us a draw. Here the same arithmetic (numpy's
`SeedSequence` hashing of a 4-word key into its 4-word pool, `generate_state(4,
uint64)`, PCG64's seeding and first output, `random()`'s 53 bits) runs on Python
ints, with the part that only the first three numbers decide worked out once per
(seed, stream, process). Tests compare it with numpy over keys of every size.
"""

from __future__ import annotations

import functools

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_M128 = (1 << 128) - 1
_INIT_A, _MULT_A = 0x43B0D7E5, 0x931E8875
_INIT_B, _MULT_B = 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = 0xCA01F9DD, 0x4973F715
_PCG_MULT = (2549297995355413924 << 64) + 4865540595714422341


def _hash_consts(start: int, mult: int, n: int) -> tuple[tuple[int, int], ...]:
  """Per call of numpy's hash, the constant the value is XORed with and the one it is then
  multiplied by (the constant advances at each call, whatever the data)."""
  out, h = [], start
  for _ in range(n):
    out.append((h, (h * mult) & _M32))
    h = out[-1][1]
  return tuple(out)


_A = _hash_consts(_INIT_A, _MULT_A, 16)  # mix_entropy: 4 + 12 hashes
_B = _hash_consts(_INIT_B, _MULT_B, 8)  # generate_state(4, uint64): 8 words


def _hashmix(value: int, consts: tuple[int, int]) -> int:
  xor, mult = consts
  value = ((value ^ xor) * mult) & _M32
  return value ^ (value >> 16)


def _mix(x: int, y: int) -> int:
  result = (_MIX_L * x - _MIX_R * y) & _M32
  return result ^ (result >> 16)


@functools.lru_cache(maxsize=64)
def _prefix(a: int, b: int, c: int) -> tuple[int, int, int, int, int, int]:
  """The pool after every step of `mix_entropy` the fourth word does not enter:
  pool words 0-2, and the three hashes of them the fourth word is mixed with."""
  pool = [_hashmix(a, _A[0]), _hashmix(b, _A[1]), _hashmix(c, _A[2])]
  # Sources 0-2 mixed into every other word (the fourth's updates left to `uniform`);
  # the hash calls keep numpy's order: source-major, destination-minor, skipping itself.
  into_fourth, k = [], 4
  for src in range(3):
    for dst in range(4):
      if dst == src:
        continue
      hashed = _hashmix(pool[src], _A[k])
      k += 1
      if dst == 3:
        into_fourth.append(hashed)
      else:
        pool[dst] = _mix(pool[dst], hashed)
  return (*pool, *into_fourth)


def uniform(a: int, b: int, c: int, d: int) -> float:
  """`np.random.default_rng([a, b, c, d]).random()`, each number in [0, 2**32)."""
  p0, p1, p2, h0, h1, h2 = _prefix(a, b, c)
  p3 = _hashmix(d, _A[3])
  p3 = _mix(_mix(_mix(p3, h0), h1), h2)
  p0 = _mix(p0, _hashmix(p3, _A[13]))
  p1 = _mix(p1, _hashmix(p3, _A[14]))
  p2 = _mix(p2, _hashmix(p3, _A[15]))
  pool = (p0, p1, p2, p3)
  words = [_hashmix(pool[i % 4], _B[i]) for i in range(8)]
  # Little-endian pairs of 32-bit words: the four 64-bit words of PCG64's seed.
  s0, s1, i0, i1 = (words[j] | (words[j + 1] << 32) for j in range(0, 8, 2))
  inc = ((((i0 << 64) | i1) << 1) | 1) & _M128
  state = inc  # PCG64's seeding: from 0, one step, add the seed, one step
  state = (state + ((s0 << 64) | s1)) & _M128
  state = (state * _PCG_MULT + inc) & _M128
  state = (state * _PCG_MULT + inc) & _M128  # the first output's step
  value = ((state >> 64) ^ state) & _M64
  rot = state >> 122
  out = ((value >> rot) | (value << ((-rot) & 63))) & _M64
  return (out >> 11) * (1.0 / 9007199254740992.0)
