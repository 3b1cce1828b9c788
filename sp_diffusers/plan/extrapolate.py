"""The block shortcut: the blocks of one list are identical, so a step's memory at each place (``plan/tracker.py``)
grows by a fixed amount per added block: a block keeps its shard of parameters, gradients and optimizer state
and, between its forward and its backward, its saved activations. FLOPs and bytes sent grow the same way.

Three kinds of block differ by their neighbours, not by their weights: the first block of a phase (its input
comes from the embeddings), the last (its output goes to the head) and the ones between. Runs with two blocks per
list (first and last) and with three in one list (one block between) show all three; the whole model is then,
place by place, the run with two blocks plus ``N - 2`` times what the third block added. Places of the blocks
between lie on a line in the block index, whose ends grow like the first and the last place: the highest of
them grows by the larger of the two slopes. ``tests/test_plan_shortcut.py`` holds this to full traces.
"""

from __future__ import annotations

from .trace import Measure
from .tracker import Place

__all__ = ["combine", "shortcut_counts"]

_FULL_BELOW = 3  # a list of at most 2 blocks is traced whole


def shortcut_counts(lists: dict[str, int]) -> list[dict[str, int]]:
    """The block counts to trace: two per list (fewer when the model has fewer), then three in each longer
    list in turn."""
    base = {name: min(count, 2) for name, count in lists.items()}
    return [base] + [{**base, name: 3} for name, count in lists.items() if count >= _FULL_BELOW]


def _sub(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a[k] - b.get(k, 0) for k in a}


def _axpy(a: dict[str, int], n: int, d: dict[str, int]) -> dict[str, int]:
    return {k: a[k] + n * d.get(k, 0) for k in a}


def combine(lists: dict[str, int], measures: list[Measure]) -> Measure:
    """The whole model's measure from the runs of :func:`shortcut_counts` (``measures`` in that order)."""
    base, grown = measures[0], [n for n, c in lists.items() if c >= _FULL_BELOW]
    variants = dict(zip(grown, measures[1:], strict=True))
    extra = {name: lists[name] - 3 for name in grown}  # blocks beyond the variant's three

    def slope(name: str, place: Place) -> dict[str, int]:
        v = variants[name]
        if place in base.places and place in v.places:
            return _sub(v.places[place], base.places[place])
        # a place between blocks of its own list: the steeper of that phase's first and last places
        ends = [(place[0], place[1], "first"), (place[0], place[1], "last")]
        cands = [_sub(v.places[e], base.places[e]) for e in ends if e in v.places and e in base.places]
        return max(cands, key=lambda d: d["total"]) if cands else {}

    places: dict[Place, dict[str, int]] = {}
    for place, parts in base.places.items():
        value = dict(parts)
        for name in grown:
            value = _axpy(value, extra[name] + 1, slope(name, place))
        places[place] = value
    for name in grown:
        for place, parts in variants[name].places.items():
            if place in base.places or place[-1] != "middle":
                continue
            value = _axpy(dict(parts), extra[name], slope(name, place))
            for other in grown:
                if other != name:
                    value = _axpy(value, extra[other] + 1, slope(other, (place[0], place[1], "last")))
            places[place] = value
    places = {p: {k: max(0, v) for k, v in parts.items()} for p, parts in places.items()}

    flops = base.flops + sum((extra[n] + 1) * (variants[n].flops - base.flops) for n in grown)
    comm: dict[tuple[str, int], float] = {}
    for key in set(base.comm).union(*(variants[n].comm for n in grown)):
        b = base.comm.get(key, 0.0)
        comm[key] = max(0.0, b + sum((extra[n] + 1) * (variants[n].comm.get(key, 0.0) - b) for n in grown))
    return Measure(places, max(0, flops), comm)
