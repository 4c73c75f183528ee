"""The `bagel-grain` command line and what backs it: demo and bench data, the bench,
row inspection, and preparing corpora (convert). None of it is on the loader's path."""
