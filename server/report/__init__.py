"""`jetsplit report DIR`: report.md with plots from a run folder, and its sections (headline
views, the split plan against what was measured, re-planning, defences)."""
