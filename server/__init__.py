"""The coordinator, one subpackage per concept, imported one way (each arrow points at what
is imported): run → report, ops → methods → training → cuts, defences, engines, fleet.
docs/architecture.md draws the whole tree."""
