"""Issue 16, classes 3 and 10: input that used to pass quietly wrong, or fail late, is refused at validate with
one line naming the file or override, the key and the fix (exit 2), and nothing is created."""

from __future__ import annotations

import pytest
import yaml

from tests.helpers import one_line_error

DEMO = "smoke_cpu"


def _assert_rejected(result, *fragments: str) -> str:
    line = one_line_error(result, *fragments)
    assert result.out == ""
    return line


# ---------------------------------------------------------------- class 10: numbers

BAD_NUMBERS = [
    ("train.lr=nan", "train.lr", "finite"),
    ("train.lr=.nan", "train.lr", "finite"),
    ("train.lr=.inf", "train.lr", "finite"),
    ("train.lr=-.inf", "train.lr", "finite"),
    ("train.grad_clip=nan", "train.grad_clip", "finite"),
    ("train.weight_decay=.nan", "train.weight_decay", "finite"),
    ("tracking.telemetry_interval_s=-5", "tracking.telemetry_interval_s", ">= 0"),
    ("tracking.telemetry_interval_s=nan", "tracking.telemetry_interval_s", "finite"),
    ("tracking.telemetry_interval_s=.inf", "tracking.telemetry_interval_s", "finite"),
    ("data.delta_timestamps={action: [0.0, .nan]}", "data.delta_timestamps.action[1]", "finite"),
    ("data.delta_timestamps={action: [.inf]}", "data.delta_timestamps.action[0]", "finite"),
    ("data.delta_timestamps={action: [nan]}", "data.delta_timestamps.action[0]", "finite"),
    ("train.steps=.inf", "train.steps", "an integer"),
    ("train.steps=-1", "train.steps", "> 0"),
    ("train.global_batch_size=-32", "train.global_batch_size", "> 0"),
    ("train.micro_batch_size=0", "train.micro_batch_size", "> 0"),
    ("train.log_every=0", "train.log_every", "> 0"),
    ("checkpoint.every_steps=-5", "checkpoint.every_steps", "> 0"),
    ("eval.every_k_checkpoints=-1", "eval.every_k_checkpoints", ">= 0"),
    ("train.warmup_steps=-10", "train.warmup_steps", ">= 0"),
]


@pytest.mark.parametrize(("override", "key", "message"), BAD_NUMBERS, ids=[o for o, _, _ in BAD_NUMBERS])
def test_non_finite_or_negative_numbers_are_refused(cli, override, key, message):
    _assert_rejected(cli("validate", DEMO, override), key, message, "override")


def test_negative_delta_timestamps_stay_allowed(cli):
    """History frames are negative offsets: a finite negative timestamp is meaningful."""
    result = cli("validate", DEMO, "data.delta_timestamps={action: [-0.1, 0.0, 0.1]}")
    assert result.code == 0, result.err


# ---------------------------------------------------------------- class 10: files

BAD_FILES = [
    ("duplicate section", "train:\n  steps: 3\ntrain:\n  lr: 0.1\n", "duplicate key 'train'"),
    ("duplicate nested key", "train:\n  steps: 3\n  lr: 0.1\n  steps: 4\n", "duplicate key 'steps'"),
    ("duplicate in flow mapping", "site:\n  extra_sbatch: {comment: a, comment: b}\n", "duplicate key"),
    ("empty file", "", "empty"),
    ("only comments", "# nothing here\n# at all\n", "empty"),
    ("only whitespace", "\n\n   \n", "empty"),
    ("null document", "~\n", "empty"),
    ("!!binary", "job:\n  name: !!binary aGVsbG8=\n", "tag"),
    ("!!set", "eval:\n  tasks: !!set {reach-v3: null}\n", "tag"),
    ("!!omap", "site:\n  env: !!omap [{A: b}]\n", "tag"),
    ("!!pairs", "site:\n  extra_sbatch: !!pairs [[comment, b]]\n", "tag"),
    ("!!timestamp", "job:\n  name: !!timestamp 2001-12-14\n", "tag"),
    ("!!python/object/apply", "job:\n  name: !!python/object/apply:os.system [touch pwned]\n", "tag"),
    ("!!python/name", "job:\n  name: !!python/name:os.system\n", "tag"),
    ("local tag", "job:\n  name: !shell x\n", "tag"),
    ("tagged mapping", "train: !!python/object:argparse.Namespace {steps: 3}\n", "tag"),
]


@pytest.mark.parametrize(("text", "message"), [(t, m) for _, t, m in BAD_FILES], ids=[n for n, _, _ in BAD_FILES])
def test_bad_recipe_file(cli, tmp_path, runs_root, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    _assert_rejected(cli("validate", str(path)), str(path), message)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("data", [b"job:\n  name: caf\xe9\n", b"\xff\xfe\x00j\x00o\x00b", b"\x89PNG\r\n\x1a\n\x00\x00",
                                  b"train:\n  steps: 3\n\xc3\x28\n"], ids=["latin-1", "utf-16", "binary", "bad utf-8"])
def test_non_utf8_recipe_is_one_line(cli, tmp_path, data):
    path = tmp_path / "bad.yaml"
    path.write_bytes(data)
    _assert_rejected(cli("validate", str(path)), str(path), "not UTF-8")


@pytest.mark.parametrize("where", ["base recipe", "site profile"])
def test_empty_base_or_site_profile_is_refused(cli, tmp_path, where):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("base: empty.yaml\n" if where == "base recipe" else "train:\n  steps: 3\n")
    args = [str(recipe)] if where == "base recipe" else [str(recipe), "--site", str(empty)]
    _assert_rejected(cli("validate", *args), str(empty), "empty")


def test_duplicate_key_in_an_override_value(cli):
    _assert_rejected(cli("validate", DEMO, "site.extra_sbatch={comment: a, comment: b}"), "override", "duplicate key")


# ---------------------------------------------------------------- class 10: extra_sbatch

RESERVED = ["output", "error", "signal", "array", "open-mode", "job-name", "dependency", "time", "partition",
            "account", "nodes", "export", "chdir", "wrap", "requeue", "kill-on-invalid-dep", "input", "gres",
            "out", "sig", "arr", "open", "depend", "job"]


@pytest.mark.parametrize("option", RESERVED)
def test_extra_sbatch_may_not_override_what_embodyhpc_sets(cli, option):
    line = _assert_rejected(cli("validate", DEMO, f"site.extra_sbatch.{option}=x"), f"site.extra_sbatch.{option}",
                            "set by embodyhpc itself")
    assert "override" in line


@pytest.mark.parametrize("option", ["output", "signal", "array"])
def test_extra_sbatch_reserved_from_a_site_profile_names_the_profile(cli, tmp_path, option):
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"site": {"extra_sbatch": {option: "x"}}}))
    _assert_rejected(cli("validate", DEMO, "--site", str(site)), str(site), f"site.extra_sbatch.{option}")


def test_extra_sbatch_other_options_still_render(cli):
    result = cli("render", DEMO, "--job", "train", "site.extra_sbatch={reservation: r1, mail-type: END, comment: c}")
    assert result.code == 0, result.err
    assert "#SBATCH --reservation=r1" in result.out and "#SBATCH --mail-type=END" in result.out
    assert result.out.count("#SBATCH --output=") == 1 and result.out.count("#SBATCH --signal=") == 1


# ---------------------------------------------------------------- class 10: errors name the right source

def test_decoded_override_is_blamed_on_the_override(cli):
    line = _assert_rejected(cli("validate", DEMO, "train.steps=${oc.decode:'{a: 1}'}"), "train.steps", "wrong type")
    assert line.startswith("error: override ") and "smoke_cpu.yaml" not in line


def test_newline_in_run_dir_names_the_option_not_the_templates(cli, tmp_path):
    line = _assert_rejected(cli("render", DEMO, "--job", "train", "--run-dir", f"{tmp_path}/a\nb"), "--run-dir")
    assert "templates_dir" not in line


@pytest.mark.parametrize(("layer", "expected"), [("recipe", "recipe.yaml"), ("site", "site.yaml"),
                                                 ("override", "override")])
def test_a_bad_value_names_the_layer_that_set_it(cli, tmp_path, layer, expected):
    recipe = tmp_path / "recipe.yaml"
    site = tmp_path / "site.yaml"
    recipe.write_text("train:\n  steps: 3\n" + ("tracking:\n  telemetry_interval_s: -1\n" if layer == "recipe" else ""))
    site.write_text("site:\n  name: s\n" + ("  extra_sbatch: {output: x}\n" if layer == "site" else ""))
    args = [str(recipe), "--site", str(site)] + (["tracking.telemetry_interval_s=nan"] if layer == "override" else [])
    line = _assert_rejected(cli("validate", *args))
    assert line.startswith(f"error: {tmp_path / expected}" if layer != "override" else "error: override"), line


# ---------------------------------------------------------------- class 3: names that escape the run folder

BAD_NAMES = [
    ("job.name", "run%j"), ("job.name", "%A_%a"), ("job.name", "a/b"), ("job.name", ".."), ("job.name", "."),
    ("job.name", "-rf"), ("job.name", ".hidden"), ("job.name", "a b"), ("job.name", "x" * 101),
    ("job.name", "x" * 300), ("job.name", "name\u00e9"), ("job.name", "a\\b"), ("job.name", "a:b"),
    ("job.name", "a*b"), ("job.name", "a$b"), ("job.experiment", "exp%x"), ("job.experiment", "../up"),
    ("job.experiment", "x" * 300), ("job.experiment", ""),
]


@pytest.mark.parametrize(("key", "value"), BAD_NAMES, ids=[f"{k}={v[:20]}" for k, v in BAD_NAMES])
def test_names_that_escape_the_run_folder_are_refused(cli, runs_root, key, value):
    _assert_rejected(cli("validate", DEMO, f"{key}={value}", f"job.runs_root={runs_root}"), key)
    assert list(runs_root.iterdir()) == []


@pytest.mark.parametrize("value", ["", "'  '"])
def test_empty_runs_root_is_refused(cli, value):
    _assert_rejected(cli("validate", DEMO, f"job.runs_root={value}"), "job.runs_root", "empty")


def test_control_characters_in_names_are_refused(cli, tmp_path):
    for text in ("job:\n  name: \"a\\nb\"\n", "job:\n  name: \"a\\tb\"\n", "job:\n  runs_root: \"/tmp/a\\rb\"\n",
                 "job:\n  experiment: \"a\\x1bb\"\n"):
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        _assert_rejected(cli("validate", str(path)), str(path))


@pytest.mark.parametrize("runs_root", ["/tmp/runs%j", "/tmp/%u/runs", "/tmp/" + "x" * 256 + "/runs",
                                       "/tmp/" + "/".join(["d" * 200] * 20)],
                         ids=["%j", "%u", "component > 255 bytes", "path too long"])
def test_runs_root_that_breaks_paths_is_refused(cli, runs_root):
    _assert_rejected(cli("validate", DEMO, f"job.runs_root={runs_root}"), "job.runs_root")


@pytest.mark.parametrize("char", ["'", '"', "?", "#", "\\"])
def test_runs_root_that_breaks_the_mlflow_sqlite_uri_is_refused(cli, tmp_path, char):
    root = f"{tmp_path}/runs{char}x"
    override = f"job.runs_root={root!r}" if char != "'" else f'job.runs_root="{root}"'
    _assert_rejected(cli("validate", DEMO, override, "tracking.enabled=true"), "job.runs_root", "tracking.mlflow_uri")


def test_runs_root_with_quotes_is_fine_without_the_default_sqlite_store(cli, tmp_path):
    for extra in ("tracking.enabled=false", "tracking.mlflow_uri=http://mlflow.example:5000"):
        result = cli("validate", DEMO, f'job.runs_root="{tmp_path}/it\'s"', extra)
        assert result.code == 0, result.err


def test_submit_of_a_long_name_creates_nothing(cli, runs_root):
    _assert_rejected(cli("submit", DEMO, "--local", "job.name=" + "n" * 300, f"job.runs_root={runs_root}"), "job.name")
    assert list(runs_root.iterdir()) == []


@pytest.mark.parametrize("runs_root", ["/tmp/runs%j", "", "/tmp/it's"])
def test_bad_runs_root_from_a_site_profile_names_the_profile(cli, tmp_path, runs_root):
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"job": {"runs_root": runs_root}, "tracking": {"mlflow_uri": None}}))
    _assert_rejected(cli("validate", DEMO, "--site", str(site), "tracking.enabled=true"), str(site), "job.runs_root")
