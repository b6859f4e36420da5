"""A zoo.json already on the target repo with escape sequences in its entries: the zoo README every later push
regenerates from it shows them as escapes (and push's own output carries none); see tests/test_hostile_strings.py."""

from __future__ import annotations

import json

from ..test_hostile_strings import HOSTILE, assert_card_safe, assert_terminal_safe
from .helpers import make_artifacts, run_cli


def test_a_hostile_zoo_json_on_the_repo_is_escaped_in_the_regenerated_readme(hf_hub, tmp_path):
    make_artifacts(tmp_path / "a", model_id="org/Alpha-1B")
    make_artifacts(tmp_path / "b", model_id="org/Beta-2B", seed=3)
    assert run_cli("push", str(tmp_path / "a"), "zoo/rotations")[0] == 0
    repo = hf_hub.state.repos["zoo/rotations"]
    zoo = json.loads(repo["commits"][repo["branches"]["main"]]["zoo.json"])
    zoo["models"][0]["model_id"] = HOSTILE["escapes"]
    zoo["models"][0]["verification"] = HOSTILE["c1-bidi"]
    hf_hub.state.tamper("zoo/rotations", "zoo.json", json.dumps(zoo).encode())
    code, out, err = run_cli("push", str(tmp_path / "b"), "zoo/rotations")
    assert code == 0, err
    assert_terminal_safe((out + err).replace("\r", "\n"), "push")  # huggingface_hub's own tqdm bars redraw with CR
    readme = repo["commits"][repo["branches"]["main"]]["README.md"].decode()
    assert_card_safe(readme, "zoo README")
    assert "x1b]0;pwned" in readme.split("---\n", 2)[2]  # in the body, shown as an escape, not dropped
