"""The menu of formats a calibration offers the precision planner, per linear.

Every calibration stores two results per linear: the requested INT4 spec (tag ``w4``) and
INT8 symmetric at ``--int8-group-size`` (tag ``w8``: g128, or g64 where 128 does not divide).
``calibrate --menu`` adds more entries computed from the same Hessians in the same pass, so a
plan at any budget needs no new calibration: e.g. ``w4g32`` (INT4, group 32, symmetric),
``w4g128-asym``, ``w4pc`` (INT4 per output channel), ``w8pc`` (INT8 per output channel),
``w5g128`` / ``w6g64-asym`` (INT5 / INT6 groupwise: native format only, on layers whose
``in_features`` is a multiple of 32; runtime kernels run them as INT8).
An entry is written like :meth:`QuantSpec.label` (``w{bits}``, ``g{size}`` or ``pc``,
``-asym``). A layer gets an entry only where its group size divides the layer's
``in_features`` and the entry differs from the layer's ``w4`` and ``w8`` specs (a 576-wide
layer has no ``w4g128``: the menu never falls back to another size, it offers what exists).

The planner's value for a layer is an *entry key*: 4 (the ``w4`` result), 8 (``w8``), None
(FP16) or a menu tag; :func:`tag_of` maps a key to the tag its tensors are stored under.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from quantpipe.core.qformat import QuantSpec, column_multiple

PRIMARY_TAGS = {4: "w4", 8: "w8"}
Entry = int | str | None  # 4, 8, a menu tag, or None (FP16)
# the menu `calibrate --menu default` computes: INT4 at the group sizes vLLM and every kernel
# take and per channel (cheaper than g128: what a plan at INT4's size trades for better
# entries elsewhere), symmetric and asymmetric, grouped INT8 (the ``w8`` result already
# where --int8-group-size is 128, then not computed twice: see layer_menu), and INT5 / INT6
# at g64 / g128 (native format only; the plans at 4.5-5.0 bits put most of their extra bits
# there) (bench/mixed_precision_menu.py measures what each buys)
DEFAULT_MENU = ("w4g32", "w4g64", "w4g128", "w4pc", "w4g32-asym", "w4g64-asym", "w4g128-asym",
                "w4pc-asym", "w8g128", "w5g64", "w5g128", "w5g64-asym", "w5g128-asym", "w6g64",
                "w6g128")

_ENTRY = re.compile(r"^w(?P<bits>\d+)(?:g(?P<gs>\d+)|(?P<pc>pc))(?P<asym>-asym)?$")


@dataclass(frozen=True)
class MenuEntry:
    bits: int
    group_size: int  # -1: per output channel
    sym: bool

    @classmethod
    def parse(cls, text: str) -> MenuEntry:
        m = _ENTRY.match(text.strip())
        if m is None:
            raise ValueError(f"menu entry {text!r}: write it like w4g32, w4g128-asym, w4pc "
                             "(per channel), w8g128 or w5g128 (bits 4, 5, 6 or 8)")
        bits, gs = int(m["bits"]), (-1 if m["pc"] else int(m["gs"]))
        try:
            QuantSpec(bits, gs, m["asym"] is None)
        except ValueError as exc:
            raise ValueError(f"menu entry {text!r}: {exc}") from None
        return cls(bits, gs, m["asym"] is None)

    @property
    def tag(self) -> str:
        return QuantSpec(self.bits, self.group_size, self.sym).label()

    def spec_for(self, in_features: int, act_order: bool) -> QuantSpec | None:
        """This entry's spec on a layer of ``in_features`` inputs (None: its group size does
        not divide them, or the layer is not a whole number of its packed words)."""
        if self.group_size != -1 and (self.group_size > in_features
                                      or in_features % self.group_size):
            return None
        if in_features % column_multiple(self.bits):
            return None
        return QuantSpec(self.bits, self.group_size, self.sym, act_order)


def parse_menu(items: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """``--menu`` values (comma lists allowed; ``default``: :data:`DEFAULT_MENU`; ``none``:
    nothing) -> canonical tags in the order given, each once."""
    out: list[str] = []
    for item in items:
        for part in str(item).split(","):
            part = part.strip()
            if not part or part == "none":
                continue
            for text in (DEFAULT_MENU if part == "default" else (part,)):
                tag = MenuEntry.parse(text).tag
                if tag not in out:
                    out.append(tag)
    return tuple(out)


def is_menu_tag(tag: str) -> bool:
    """A stored tag of a menu entry (not the ``w4`` / ``w8`` every calibration has)."""
    return tag not in PRIMARY_TAGS.values()


def allowed_entries(menu: tuple[str, ...]) -> set[Entry] | None:
    """``plan``/``export --menu`` -> the entry keys the budget planner may use (None: all):
    ``w4``, ``w8``, ``fp16`` and menu tags, comma lists allowed."""
    if not menu:
        return None
    parts = [p.strip().lower() for item in menu for p in item.split(",")]
    primary = {"fp16": None, "16": None, "w4": 4, "w8": 8}
    return ({primary[p] for p in parts if p in primary}
            | set(parse_menu(tuple(p for p in parts if p not in primary))))


def layer_menu(menu: tuple[str, ...], in_features: int, act_order: bool,
               primary: tuple[QuantSpec, ...]) -> dict[str, QuantSpec]:
    """tag -> spec of every menu entry one layer gets (see the module docstring)."""
    taken = {(s.bits, s.group_size, s.sym) for s in primary}
    out = {}
    for tag in menu:
        spec = MenuEntry.parse(tag).spec_for(in_features, act_order)
        if spec is not None and (spec.bits, spec.group_size, spec.sym) not in taken:
            out[tag] = spec
    return out


def tag_of(entry: Entry) -> str:
    """The tag a layer's result for a plan's entry key is stored under (not for FP16)."""
    if entry is None:
        raise ValueError("FP16 has no stored quantized result")
    return PRIMARY_TAGS[entry] if isinstance(entry, int) else entry


def entry_of(tag: str) -> Entry:
    """The inverse of :func:`tag_of`: a stored tag -> the plan's entry key."""
    return {v: k for k, v in PRIMARY_TAGS.items()}.get(tag, tag)


def entry_label(entry: Entry, spec: QuantSpec | None) -> str:
    """How a plan names an entry to the user: fp16, or the spec's label."""
    return "fp16" if entry is None or spec is None else spec.label()
