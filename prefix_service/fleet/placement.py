"""Template placement by rendezvous (highest-random-weight) hashing.

Each (template, replica) pair gets a pseudo-random weight from a hash of both names; a template
lives on the R replicas with the highest weights. Every process computes the same answer from the
same member list, and a change of membership moves only the templates whose top R changed: a new
replica takes over about R/N of the templates, a leaving one hands each of its templates to the
next replica in that template's order, and nothing else moves.
"""
from __future__ import annotations

import hashlib
from typing import Iterable, Sequence


def weight(template: str, replica: str) -> int:
    """The pair's rendezvous weight (64 bits, stable across processes and Python versions)."""
    digest = hashlib.blake2b(f"{template}\x00{replica}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def holders(template: str, replicas: Iterable[str], replication: int | None) -> list[str]:
    """The replicas that should pin template, best first: the `replication` highest weights
    (None: every replica). Ties, which need a 64-bit collision, break on the replica id."""
    ranked = sorted(set(replicas), key=lambda r: (weight(template, r), r), reverse=True)
    return ranked if replication is None else ranked[:replication]


def placement(templates: Iterable[str], replicas: Sequence[str], replication: int | None) -> dict[str, list[str]]:
    """template -> its holders, for every template."""
    return {t: holders(t, replicas, replication) for t in templates}
