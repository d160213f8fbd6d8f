"""docs/architecture.md stays true where it lists what the code defines."""

from __future__ import annotations

from pathlib import Path

from pipeplan.sim.graph import NodeKind

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def test_the_step_graph_section_names_every_node_kind():
    text = DOC.read_text()
    assert [k.name for k in NodeKind if f"`{k.name}`" not in text] == []
