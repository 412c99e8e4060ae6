"""Sample order: a stateless, seeded permutation of the corpus windows, one per epoch.

Global sample index i -> epoch e = i // n, window w = perm_{seed,e}(i % n), start = w * stride.
Nothing is stored: any rank, any process, any restart computes the same start for the same
(seed, i), which is what makes rollback replay exact (DESIGN.md, "Rollback semantics").

The permutation is a 4-round Feistel network over the smallest even-bit power of two >= n,
with cycle walking to stay inside [0, n) (Black & Rogaway, "Ciphers with Arbitrary Finite
Domains", 2002). A bijection, unlike a plain hash, visits every window exactly once per epoch.
The round function is splitmix64's finaliser (Steele et al., "Fast splittable pseudorandom
number generators", 2014). Everything is vectorised over numpy uint64 arrays, which wrap on
overflow like the C original.
"""

from __future__ import annotations

import numpy as np

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_MIX1 = _U64(0xBF58476D1CE4E5B9)
_MIX2 = _U64(0x94D049BB133111EB)
_ROUNDS = 4  # 4 rounds: the Luby-Rackoff bound for a strong pseudorandom permutation
_MASK64 = (1 << 64) - 1


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 of every element of a uint64 array (returns a new array)."""
    x = np.asarray(x, dtype=_U64)
    # ndmin=1: numpy warns on 0-d (scalar) overflow but wraps arrays silently, as we want.
    z = np.array(x, dtype=_U64, ndmin=1) + _GOLDEN
    z = (z ^ (z >> _U64(30))) * _MIX1
    z = (z ^ (z >> _U64(27))) * _MIX2
    return (z ^ (z >> _U64(31))).reshape(x.shape)


def _half_bits(n: int) -> int:
    """Bits per Feistel half so that 2**(2*h) >= n (at least 1)."""
    bits = max(1, int(n - 1).bit_length())
    return (bits + 1) // 2


def _feistel(x: np.ndarray, round_keys: np.ndarray, h: int) -> np.ndarray:
    """One pass of the Feistel network over [0, 4**h); round_keys has shape (len(x), ROUNDS)."""
    mask = _U64((1 << h) - 1)
    sh = _U64(h)
    left, right = x >> sh, x & mask
    for r in range(_ROUNDS):  # loop over rounds, not elements
        left, right = right, left ^ (splitmix64(right ^ round_keys[:, r]) & mask)
    return (left << sh) | right


def permute(j: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """perm_key(j) for each j in [0, n): a bijection of [0, n) per distinct key.

    `keys` is a uint64 array broadcastable to j (one key per element, e.g. per epoch).
    """
    if n <= 0:
        raise ValueError(f"permutation domain must be positive, got n={n}")
    j = np.asarray(j, dtype=_U64)
    shape = j.shape
    j = j.reshape(-1)
    keys = np.broadcast_to(np.asarray(keys, dtype=_U64).reshape(-1), j.shape)
    if n == 1:
        return np.zeros(shape, dtype=_U64)
    h = _half_bits(n)
    round_keys = splitmix64(keys[:, None] + np.arange(1, _ROUNDS + 1, dtype=_U64)[None, :] * _GOLDEN)
    out = _feistel(j, round_keys, h)
    # Cycle walking: re-encrypt the few values that fell outside [0, n). The domain is < 4n,
    # so the expected number of passes is below 4; each pass is vectorised.
    bad = np.flatnonzero(out >= _U64(n))
    while bad.size:
        out[bad] = _feistel(out[bad], round_keys[bad], h)
        bad = bad[out[bad] >= _U64(n)]
    return out.reshape(shape)


def epoch_keys(seed: int, epochs: np.ndarray) -> np.ndarray:
    """One permutation key per epoch, derived from the run seed."""
    base = _U64(seed & _MASK64)
    return splitmix64(np.asarray(epochs, dtype=_U64) ^ base)


def sample_windows(sample_ids: np.ndarray, n_windows: int, seed: int) -> np.ndarray:
    """Window index (int64) of each absolute sample id; a fresh permutation every epoch."""
    ids = np.asarray(sample_ids, dtype=np.int64)
    if ids.size and ids.min() < 0:
        raise ValueError(f"sample ids must be >= 0, got min {int(ids.min())}")
    epochs, within = np.divmod(ids, n_windows)
    return permute(within.astype(_U64), n_windows, epoch_keys(seed, epochs)).astype(np.int64)
