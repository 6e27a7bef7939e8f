"""GR00T's spec at validate: its own options (model.options.*) and its checks of the shared model keys, refused in
one line without importing torch; the tokenizer file the full size needs."""

from __future__ import annotations

import pytest

from embodyhpc.errors import ConfigError
from embodyhpc.validation import load_recipe

DEMO = "recipes/demo_groot_metaworld_cpu.yaml"


@pytest.mark.parametrize(("override", "message"), [
    ("model.options.embodiment_id=32", "model.options.embodiment_id: must be in 0..31, got 32"),
    ("model.options.embodiment_id=-1", "model.options.embodiment_id: must be in 0..31, got -1"),
    ("model.options.embodiment_id=new", "model.options.embodiment_id: wrong type: expected an integer"),
    ("model.options.tune_llm=sometimes", "model.options.tune_llm: wrong type"),
    ("model.options.select_layer=12", "model.options.select_layer: the groot model has no option 'select_layer'"),
    ("model.size=small", "model.size: unknown groot size 'small'; known: tiny, full"),
    ("model.action_horizon=65", "model.action_horizon: 65 steps exceed the 64 action positions of size tiny"),
    ("model.state_input=expert", "model.state_input: model.state_input is a pi0.5 option"),
    ("model.state_dim=40", "model.state_dim: model.state_dim is a pi0.5 option"),
])
def test_bad_groot_keys_are_refused_in_one_line(override, message):
    with pytest.raises(ConfigError) as caught:
        load_recipe(DEMO, [override])
    assert message in str(caught.value) and "\n" not in str(caught.value)


NOT_MOUNTED = "/nonexistent-fs-embodyhpc/demos"  # a cluster path: validate checks what it can, the job the rest


def test_validate_through_the_cli_refuses_with_exit_2(cli):
    result = cli("validate", DEMO, f"data.root={NOT_MOUNTED}", "model.options.embodiment_id=99")
    assert result.code == 2 and len(result.err.strip().splitlines()) == 1
    assert "model.options.embodiment_id: must be in 0..31, got 99" in result.err
    assert cli("validate", DEMO, f"data.root={NOT_MOUNTED}").code == 0


def test_the_full_size_warns_then_refuses_without_its_tokenizer(cli, tmp_path):
    result = cli("validate", "recipes/groot_n15_bf16.yaml", f"data.root={NOT_MOUNTED}")
    assert result.code == 0
    assert "model.tokenizer_path is unset: the full-size GR00T needs Eagle 2.5's Qwen3 tokenizer file" in result.err


def test_validating_a_groot_recipe_imports_no_torch():
    import json
    import subprocess
    import sys

    code = ("import json, sys\nfrom embodyhpc.validation import load_recipe\n"
            f"load_recipe({DEMO!r}, ['model.options.tune_visual=true'])\n"
            "print(json.dumps('torch' in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) is False
