"""The block shortcut: the blocks of one list are identical, so a step's memory at each place (``plan/tracker.py``)
grows by a fixed amount per added block: a block keeps its shard of parameters, gradients and optimizer state
and, between its forward and its backward, its saved activations. FLOPs and bytes sent grow the same way.

Blocks differ by their neighbours, not by their weights: the first block of a phase takes the embeddings' output,
the last feeds the head, and FSDP keeps the previous block's reduce-scatter buffer while the next block runs
backward, so a block next to the first or the last one differs too. Runs with three blocks per list (first,
one between, last: the ends have ordinary neighbours) and with four in one list (two between, each next to an
end, as the blocks of the whole model that hold the most) show every kind. The whole model is then, place by
place, the three-block run plus ``N - 3`` times what the fourth block added (and so are the collectives an
iteration's pieces count, ``plan/iteration.py``: calls and bytes per block, exactly); the places between lie on a line in
the block index whose ends grow like the first and the last place, so the highest of them is the four-block
run's, grown by the steeper of the two. ``tests/test_plan_shortcut.py`` holds this to full traces.

The collectives an iteration's pieces count (``plan --rl``) do not depend on a block's neighbours: each block
gathers, reduce-scatters and exchanges what any other does, whether it is the first, the last or the only one of
its list. The pieces are counted on one block per list, then two in each longer list in turn
(:func:`ledger_counts`), grown by what the second added (:func:`grown_pieces`): the same integers as from the
runs of three and four blocks, at a fraction of their time (most of an ``--rl`` plan's tracing is these pieces:
ten rollout forwards and four training micro-steps per layout). ``tests/test_plan_shortcut.py`` holds both to full
traces. One exception, for either pair of runs: the optimizer's gradient-norm all-reduce is one call whose size
grows with the block count, and the ledger rounds each call's bytes down (``parallel/ledger.py``), so its bytes
grow by a rounded step: off by a few bytes per block (Wan2.1-1.3B, full fine-tuning, 30 blocks: 5774 traced
whole, 5748 from three and four blocks, 5746 from one and two).
"""

from __future__ import annotations

from .trace import Measure
from .tracker import Place

__all__ = ["combine", "grown_pieces", "ledger_counts", "shortcut_counts"]

BASE = 3  # blocks per list in the base run; a list of at most BASE blocks is traced whole
LEDGER_BASE = 1  # blocks per list in the base run of the iteration's pieces


def shortcut_counts(lists: dict[str, int]) -> list[dict[str, int]]:
    """The block counts to trace: three per list (fewer when the model has fewer), then four in each longer
    list in turn."""
    base = {name: min(count, BASE) for name, count in lists.items()}
    return [base] + [{**base, name: BASE + 1} for name, count in lists.items() if count > BASE]


def ledger_counts(lists: dict[str, int]) -> list[dict[str, int]]:
    """The block counts to count the iteration's pieces on: one per list, then two in each longer list in turn."""
    base = {name: min(count, LEDGER_BASE) for name, count in lists.items()}
    return [base] + [{**base, name: LEDGER_BASE + 1} for name, count in lists.items() if count > LEDGER_BASE]


def grown_pieces(lists: dict[str, int], pieces: list[dict]) -> dict:
    """The whole model's iteration pieces from the runs of :func:`ledger_counts` (``pieces`` in that order)."""
    base, grown = pieces[0], [n for n, c in lists.items() if c > LEDGER_BASE]
    variants = dict(zip(grown, pieces[1:], strict=True))
    return {name: _grown_ledger(lists, base, variants, name, LEDGER_BASE) for name in base}


def _sub(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a[k] - b.get(k, 0) for k in a}


def _axpy(a: dict[str, int], n: int, d: dict[str, int]) -> dict[str, int]:
    return {k: a[k] + n * d.get(k, 0) for k in a}


def combine(lists: dict[str, int], measures: list[Measure]) -> Measure:
    """The whole model's measure from the runs of :func:`shortcut_counts` (``measures`` in that order)."""
    base, grown = measures[0], [n for n, c in lists.items() if c > BASE]
    variants = dict(zip(grown, measures[1:], strict=True))
    extra = {name: lists[name] - BASE for name in grown}  # blocks beyond the base run's

    def slope(name: str, place: Place) -> dict[str, int]:
        """What one more block of list ``name`` adds at ``place``; between blocks of that list: the steeper
        of that phase's first and last places."""
        v = variants[name]
        if place[-1] != "middle" or place[1] != name:
            return (
                _sub(v.places[place], base.places[place])
                if place in v.places and place in base.places
                else {}
            )
        ends = [(place[0], name, "first"), (place[0], name, "last")]
        cands = [_sub(v.places[e], base.places[e]) for e in ends if e in v.places and e in base.places]
        return max(cands, key=lambda d: d["total"]) if cands else {}

    places: dict[Place, dict[str, int]] = {}
    for place, parts in base.places.items():
        if place[-1] == "middle" and place[1] in variants:
            continue  # its own list grows: the variant's places between blocks anchor it (below)
        value = dict(parts)
        for name in grown:
            value = _axpy(value, extra[name], slope(name, place))
        places[place] = value
    for name in grown:
        for place, parts in variants[name].places.items():
            if place[-1] != "middle" or place[1] != name:
                continue
            value = _axpy(dict(parts), extra[name] - 1, slope(name, place))
            for other in grown:
                if other != name:
                    value = _axpy(value, extra[other], slope(other, (place[0], place[1], "last")))
            places[place] = value
    places = {p: {k: max(0, v) for k, v in parts.items()} for p, parts in places.items()}

    flops = base.flops + sum(extra[n] * (variants[n].flops - base.flops) for n in grown)
    comm: dict[tuple[str, int], float] = {}
    for key in set(base.comm).union(*(variants[n].comm for n in grown)):
        b = base.comm.get(key, 0.0)
        comm[key] = max(0.0, b + sum(extra[n] * (variants[n].comm.get(key, 0.0) - b) for n in grown))
    pieces = {
        name: _grown_ledger(lists, base.pieces, {n: v.pieces for n, v in variants.items()}, name, BASE)
        for name in base.pieces
    }
    per_step = combine(lists, [m.per_step for m in measures]) if base.per_step is not None else None
    held = combine(lists, [m.held_update for m in measures]) if base.held_update is not None else None
    return Measure(places, max(0, flops), comm, pieces, per_step, held)


def _grown_ledger(lists: dict[str, int], base: dict, variants: dict[str, dict], piece: str, at: int) -> dict:
    """A ledger piece of the whole model from runs of ``at`` blocks per list (``base``) and one more in a list
    (``variants``): calls and bytes grow by what one more block adds (integers, exact)."""
    out = {}
    keys = set(base[piece]).union(*(v[piece] for v in variants.values()))
    for key in keys:
        b = base[piece].get(key, (0, 0))
        value = list(b)
        for name, v in variants.items():
            more = v[piece].get(key, (0, 0))
            for i in (0, 1):
                value[i] += (lists[name] - at) * (more[i] - b[i])
        if value[0]:
            out[key] = (value[0], value[1])
    return out
