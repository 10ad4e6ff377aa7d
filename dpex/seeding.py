"""Reproducible draws: a sample's random numbers are keyed by the epoch's
base seed and the sample's place in the epoch's plan, never by which worker
or process makes it.

torch's DataLoader seeds worker k with ``base_seed + k`` once per epoch, so
a sample's draws depend on which worker made it (batch i goes to worker
i mod num_workers). A Dpex batch goes to whichever process is free, on
whichever worker, possibly again after a failure; so before each sample the
batch process sets torch's, numpy's and ``random``'s global generators from
``for_sample(base_seed, place)``, and before ``collate_fn`` from
``for_collate(base_seed, place of the batch's first sample)``; user code
that keeps generators of its own reads the seed with ``dpex.sample_seed()``. A place is
the sample's position in the epoch's sampler order, the same whatever the
batch size and (for DistributedSampler, dpex.ShuffleSampler) the number of
ranks: see ``SamplerSpec.place_offset`` and ``dpex.plan.samplers.places``.

The base seed is what torch's DataLoader draws at ``iter()`` (from the
loader's ``generator``, or torch's global RNG), so a run seeded as a torch
run is seeded alike.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Any

_SAMPLE, _COLLATE, _EPOCH = b"dpex-sample", b"dpex-collate", b"dpex-epoch"
_KEY = struct.Struct("<qq")
_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1

_current: int | None = None  # the seed of the sample (or collate) being made in this process


def _derive(domain: bytes, base_seed: int, place: int) -> int:
    # Signed 64-bit packing: a base seed is torch's int64 draw, a place may be any int64.
    base = ((base_seed + (1 << 63)) & _MASK64) - (1 << 63)
    digest = hashlib.blake2b(_KEY.pack(base, place), digest_size=8, person=domain).digest()
    # In torch's range of seeds, [0, 2**63): torch.initial_seed() of a sample fits an int64 (a
    # dataset that returns it is collated by default_collate).
    return int.from_bytes(digest, "little") & _MASK63


def for_sample(base_seed: int, place: int) -> int:
    """The seed (in [0, 2**63)) of the sample at ``place`` of an epoch of ``base_seed``."""
    return _derive(_SAMPLE, base_seed, place)


def for_epoch(base_seed: int, epoch: int) -> int:
    """The base seed of epoch ``epoch`` of a loader whose workers persist
    (torch seeds them once, from the first epoch's base seed)."""
    return _derive(_EPOCH, base_seed, epoch)


def for_collate(base_seed: int, place: int) -> int:
    """The seed of collate_fn for the batch whose first sample is at ``place``."""
    return _derive(_COLLATE, base_seed, place)


def seed_globals(seed: int, skip: frozenset = frozenset()) -> None:
    """Sets torch's (CPU), numpy's and ``random``'s global generators from
    ``seed``, as torch's DataLoader seeds a worker (torch and ``random`` with
    the seed, numpy with 32 bits of it); not those named in ``skip`` (the
    user's: see :func:`seeded_since`)."""
    global _current
    import random

    import numpy as np
    import torch
    _current = seed
    if "random" not in skip:
        random.seed(seed)
    if "torch" not in skip:
        torch.default_generator.manual_seed(seed)  # torch.manual_seed would also seed every accelerator: 100x slower
    if "numpy" not in skip:
        np.random.seed(seed & 0xFFFFFFFF)


_MT_WORDS = 624      # the Mersenne Twister's words: regenerated every 624 draws
_MAX_REGENERATIONS = 64  # draws told from a seeding: up to 624 * 64 words between the marks (9 ms to search)


def seed_marks() -> dict[str, Any]:
    """The global generators' states (torch: its initial seed, which a draw
    does not change), taken before and after a ``worker_init_fn``."""
    import random

    import numpy as np
    import torch
    return {"random": random.getstate(), "torch": torch.initial_seed(), "numpy": np.random.get_state()}


def seeded_since(marks: dict[str, Any]) -> frozenset:
    """The generators seeded since ``marks`` were taken: the user's from then
    on (a ``worker_init_fn`` that seeds torch keeps torch's generator as
    torch's DataLoader would), which keyed draws leave alone. A generator only
    drawn from is not seeded, however many draws (``_drawn``)."""
    now = seed_marks()
    seeded = {"torch"} if now["torch"] != marks["torch"] else set()
    if not _drawn(_random_words(marks["random"]), _random_words(now["random"]), _random_after):
        seeded.add("random")
    if not _drawn(_numpy_words(marks["numpy"]), _numpy_words(now["numpy"]), _numpy_after):
        seeded.add("numpy")
    return frozenset(seeded)


def _drawn(before: Any, after: Any, regenerate: Any) -> bool:
    """``after`` is what draws from ``before`` reach: the words are equal, or
    equal after some regenerations (a Mersenne Twister makes its next 624
    words from its last ones, whatever was drawn)."""
    if before is None or after is None:
        return before == after
    words = before
    for _ in range(_MAX_REGENERATIONS + 1):
        if words == after:
            return True
        words = regenerate(words)
    return False


def _random_words(state: tuple) -> tuple | None:
    version, internal, _ = state
    return (version, internal[:-1]) if len(internal) == _MT_WORDS + 1 else None


def _random_after(words: tuple) -> tuple:
    import random
    r = random.Random(0)
    r.setstate((words[0], (*words[1], _MT_WORDS), None))  # at the end of its words: the next draw regenerates
    r.getrandbits(32)
    return _random_words(r.getstate())


def _numpy_words(state: tuple) -> bytes | None:
    return state[1].tobytes() if state[0] == "MT19937" else None


def _numpy_after(words: bytes) -> bytes:
    import numpy as np
    r = np.random.RandomState(0)  # any state: set_state replaces it (no seed would read the OS's entropy)
    r.set_state(("MT19937", np.frombuffer(words, dtype=np.uint32), _MT_WORDS, 0, 0.0))
    r.random_sample()  # two words, from regenerated ones
    return _numpy_words(r.get_state())


def clear() -> None:
    """No sample is being made any more (sample_seed() is None)."""
    global _current
    _current = None


_asked = False  # the sample being made read sample_seed() (a generator of its own): see drew_since


def draw_marks() -> tuple:
    """What :func:`drew_since` compares: the global generators' states, taken
    before a sample is made."""
    global _asked
    _asked = False
    return global_states()


def drew_since(marks: tuple) -> bool:
    """Whether the code run since :func:`draw_marks` drew a random number
    from torch's, numpy's or ``random``'s global generator, or read
    :func:`sample_seed` for a generator of its own: exactly, by the states.
    (A generator seeded from the OS's entropy inside the code is not seen.)"""
    import numpy as np
    import torch
    now = global_states()
    if _asked or now[0] != marks[0] or not torch.equal(now[1], marks[1]):
        return True
    (_, words, pos, *gauss), (_, was_words, was_pos, *was_gauss) = now[2], marks[2]
    return pos != was_pos or gauss != was_gauss or not np.array_equal(words, was_words)


def sample_seed() -> int | None:
    """The seed of the sample being made, for code that keeps generators of its own.

    In a Dpex batch process, the seed its global generators were set from (in ``collate_fn``: the
    batch's).

    Returns:
        The seed; None elsewhere (the trainer, a torch DataLoader's worker, a loader with
        ``reproducible=False``)."""
    global _asked
    _asked = True
    return _current


def sample_generator() -> Any:
    """A new ``torch.Generator`` seeded with :func:`sample_seed`.

    Returns:
        The generator; None where :func:`sample_seed` is None."""
    seed = sample_seed()
    if seed is None:
        return None
    import torch
    return torch.Generator().manual_seed(seed)


def global_states() -> tuple:
    """The states of ``random``'s, torch's (CPU) and numpy's global generators."""
    import random

    import numpy as np
    import torch
    return random.getstate(), torch.get_rng_state(), np.random.get_state()


def restore_global_states(states: tuple) -> None:
    """Puts the generators back where :func:`global_states` found them."""
    import random

    import numpy as np
    import torch
    random.setstate(states[0])
    torch.set_rng_state(states[1])
    np.random.set_state(states[2])
