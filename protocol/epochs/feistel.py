"""The keyed bijection epoch order 2 is built from: a Feistel network with cycle walking over ``[0, n)``.

``keyed_bijection(values, n, keys)`` maps each value below ``n`` to another below ``n``, one-to-one, under round keys
``round_keys(seed, epoch, tag)`` chained with splitmix64's finaliser (``mix``, ``chain``); docs/protocol.md
("Epoch order 2") defines each step bit for bit. Vectorised over NumPy uint64 arrays, wrapping modulo 2**64.
"""

from __future__ import annotations

import numpy as np

#: Feistel rounds. Luby and Rackoff's bound asks 4 of ideal round functions; ours are one fixed mixer keyed
#: by XOR, and the halves are as narrow as 1 bit for small windows, where Patarin's bounds ask more rounds
#: of a Feistel network than 4. 8 doubles the ideal count; each round is one mixer call per value.
ROUNDS = 8
GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment: keeps a step of the key chain away from mix(0) == 0
SHARDS_TAG = 2**64 - 1  # the shard permutation's domain tag; windows use their index w < 2**24
_U64 = 2**64 - 1


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of a uint64 array, wrapping modulo 2**64 (a new array)."""
    x = np.array(x, dtype=np.uint64, ndmin=1)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def chain(h: np.ndarray | int, v: np.ndarray | int) -> np.ndarray:
    """One step of the key chain: ``mix(((h XOR v) + GOLDEN) mod 2**64)``."""
    xored = np.array(h, dtype=np.uint64, ndmin=1) ^ np.array(v, dtype=np.uint64, ndmin=1)
    return mix(xored + np.uint64(GOLDEN))


def round_keys(seed: int, epoch: int, tags: np.ndarray | int) -> np.ndarray:
    """uint64 ``[ROUNDS, len(tags)]``: key ``i`` of domain ``tag`` is
    ``chain(chain(chain(chain(0, seed mod 2**64), epoch), tag), i)``."""
    base = chain(chain(chain(0, seed % 2**64), epoch), tags)
    return np.stack([chain(base, i) for i in range(ROUNDS)])


def _feistel_bits(n: np.ndarray) -> np.ndarray:
    """The smallest even ``b >= 2`` with ``2**b >= n``, per element (n <= 2**40: exact in float64)."""
    bits = np.frexp(np.asarray(n, dtype=np.float64) - 1.0)[1].astype(np.uint64)  # bit length of n - 1
    return np.maximum(bits + (bits & np.uint64(1)), np.uint64(2))


def _rounds(x: np.ndarray, keys: np.ndarray, half: np.ndarray, inverse: bool) -> np.ndarray:
    mask = (np.uint64(1) << half) - np.uint64(1)
    left, right = x >> half, x & mask
    if inverse:  # undo (L, R) -> (R, L ^ F(R)) last round first
        for key in keys[::-1]:
            left, right = right ^ (mix(left ^ key) & mask), left
    else:
        for key in keys:
            left, right = right, left ^ (mix(right ^ key) & mask)
    return (left << half) | right


def keyed_bijection(values: np.ndarray, n: np.ndarray | int, keys: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Each value ``v < n`` through the keyed bijection of ``[0, n)`` (or its inverse), as uint64.

    ``n``: one domain size or one per value; ``keys``: ``[ROUNDS]`` or ``[ROUNDS, len(values)]``
    (``round_keys``). A Feistel network on ``b`` bits, re-applied while the value is ``>= n`` (cycle walking:
    a value in range always comes back into range, since the network permutes ``[0, 2**b)``; ``2**b <= 4n``,
    so under 4 applications on average). The walk loops over the shrinking subset still out of range.
    ValueError for a value ``>= n``.
    """
    values = np.array(values, dtype=np.uint64, ndmin=1)
    n = np.asarray(n, dtype=np.uint64)
    keys = np.asarray(keys, dtype=np.uint64)
    if np.any(values >= n):  # a walk that starts out of range may cycle out of range for ever
        raise ValueError(f"keyed_bijection takes values below their domain size n, got {values[values >= n][:3]}")
    half = _feistel_bits(n) >> np.uint64(1)

    def take(a: np.ndarray, idx: np.ndarray, per_value_ndim: int) -> np.ndarray:
        return a[..., idx] if a.ndim == per_value_ndim else a

    out = _rounds(values, keys, half, inverse)
    walking = np.flatnonzero(out >= n)
    while walking.size:
        out[walking] = _rounds(out[walking], take(keys, walking, 2), take(half, walking, 1), inverse)
        walking = walking[out[walking] >= take(n, walking, 1)]
    return out
