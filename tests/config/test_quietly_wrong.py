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


# ---------------------------------------------------------------- hardening round 3, class 5: numbers
# Chosen behaviour: an integer written so that readers disagree (YAML 1.1: 010 is 8, YAML 1.2 and Python: 10; 0x10,
# 0o10, 0b11, 1_000, base-60 1:30) is refused, from a file and from an override alike, with the decimal to write.
# String fields keep such text as written. Values no run can mean are refused; legal but large ones warn.

SPELLINGS = [  # (value as written, what the message says, the decimal the fix names)
    ("010", "leading zero", "write 10"), ("-010", "leading zero", "write -10"), ("09", "leading zero", "write 9"),
    ("00", "leading zero", "write 0"), ("0x10", "hexadecimal", "write 16"), ("0o10", "octal", "write 8"),
    ("0b11", "binary", "write 3"), ("1_000", "digit separators", "write 1000"), ("1:30", "base-60", "write 90"),
    ("'010'", "leading zero", "write 10"), ("1e3", "not written as an integer", "write 1000"),
]


@pytest.mark.parametrize(("key", "value", "message", "fix"),
                         [(k, v, m, f) for k in ("train.steps", "resources.nodes", "network.gid_index")
                          for v, m, f in SPELLINGS], ids=lambda x: str(x))
def test_ambiguous_integers_in_an_override_are_refused_with_the_decimal(cli, key, value, message, fix):
    _assert_rejected(cli("validate", DEMO, f"{key}={value}"), "error: override", key, message, f"(fix: {fix})")


@pytest.mark.parametrize(("section", "text", "key", "fix"), [
    ("train", "steps: 010", "train.steps", "write 10"),
    ("resources", "nodes: 010", "resources.nodes", "write 10"),
    ("eval", "seeds: [0x10]", "eval.seeds[0]", "write 16"),
    ("checkpoint", "every_steps: 1_000", "checkpoint.every_steps", "write 1000"),
    ("train", "log_every: 1:30", "train.log_every", "write 90"),
    ("model", "options: {}\n  action_horizon: 0b11", "model.action_horizon", "write 3"),
])
def test_ambiguous_integers_in_a_file_are_refused_the_same_way(cli, tmp_path, section, text, key, fix):
    path = tmp_path / "recipe.yaml"
    path.write_text(f"base: {DEMO}\n{section}:\n  {text}\n")
    _assert_rejected(cli("validate", str(path)), str(path), key, f"(fix: {fix})")


def test_text_fields_keep_numbers_as_written(cli, tmp_path):
    """YAML 1.1 turned `account: 010` into "8" and `OMP_NUM_THREADS: 010` into 8: now the text is what was written."""
    from embodyhpc.validation import load_recipe

    path = tmp_path / "recipe.yaml"
    path.write_text(f"base: {DEMO}\njob:\n  name: '010'\nsite:\n  account: 010\n  qos: 0x10\n"
                    "  env: {OMP_NUM_THREADS: 010, OTHER: 1_000}\nresources:\n  time: 010\n")
    config = load_recipe(str(path)).config
    assert (config.site.account, config.site.qos, config.job.name) == ("010", "0x10", "010")
    assert config.site.env == {"OMP_NUM_THREADS": "010", "OTHER": "1_000"}
    assert config.resources.time == "010" and load_recipe(str(path)).resolved.train_time_min == 10
    result = cli("render", str(path), "--job", "train")
    assert result.code == 0, result.err
    assert "--account=010" in result.out and "OMP_NUM_THREADS=010" in result.out


def test_plain_numbers_still_read(cli):
    from embodyhpc.validation import load_recipe

    config = load_recipe(DEMO, ["train.steps=+10", "train.seed=0", "train.lr=3e-4", "train.grad_clip=1.0e+0",
                                "train.weight_decay=0.", "network.gid_index=-1", "checkpoint.every_steps=5.0"]).config
    assert (config.train.steps, config.train.lr, config.train.grad_clip) == (10, 3e-4, 1.0)
    assert (config.network.gid_index, config.checkpoint.every_steps, config.train.weight_decay) == (-1, 5, 0.0)


@pytest.mark.parametrize(("override", "key", "message"), [
    ("train.lr=0x10", "train.lr", "expected a number"), ("train.lr=1_0.5", "train.lr", "expected a number"),
    ("train.steps=.inf", "train.steps", "an integer"), ("train.steps=-.inf", "train.steps", "an integer"),
    ("train.steps=.nan", "train.steps", "an integer"), ("resources.nodes=1.5", "resources.nodes", "an integer"),
    ("train.steps=9223372036854775808", "train.steps", "does not fit a 64-bit integer"),
    ("train.steps=-9223372036854775809", "train.steps", "does not fit a 64-bit integer"),
    ("train.seed=" + "9" * 40, "train.seed", "does not fit a 64-bit integer"),
    ("train.seed=-1", "train.seed", "0 .. 4294967295"), ("train.seed=4294967296", "train.seed", "0 .. 4294967295"),
    ("eval.seeds=[-1]", "eval.seeds", "seed"), ("eval.seeds=[0, 99999999999]", "eval.seeds", "seed"),
])
def test_numbers_no_run_can_mean_are_refused(cli, override, key, message):
    _assert_rejected(cli("validate", DEMO, override), "override", key, message)


def test_seeds_at_their_bounds_are_fine(cli):
    assert cli("validate", DEMO, "train.seed=4294967295").code == 0


# sbatch --time accepts: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
# days-hours:minutes:seconds (and UNLIMITED / INFINITE / -1, which embodyhpc refuses: see checks.slurm_time_minutes)
SLURM_TIMES = [("90", 90), ("90:30", 91), ("1:00:00", 60), ("25:00:00", 1500), ("2-0", 2880), ("2-03:00", 2880 + 180),
               ("2-03:04:05", 2880 + 184 + 1), ("0:30", 1), ("010", 10)]


@pytest.mark.parametrize(("time", "minutes"), SLURM_TIMES, ids=[t for t, _ in SLURM_TIMES])
def test_every_slurm_time_format_reads_as_sbatch_reads_it(time, minutes):
    from embodyhpc.validation import load_recipe

    resolved = load_recipe(DEMO, [f"resources.time={time}", "resources.signal_delay_s=0", f"eval.time={time}"]).resolved
    assert resolved.train_time_min == minutes and resolved.eval_time_min == minutes


@pytest.mark.parametrize(("time", "message"), [
    ("UNLIMITED", "no time limit"), ("infinite", "no time limit"), ("INFINITE", "no time limit"),
    ("-1", "no time limit"), ("24855-03:14:08", "past the 2147483647"), ("99999999999", "not a Slurm time"),
    ("1.5", "not a Slurm time"), ("1-24:00:00", "out of range"), ("1:60", "out of range"), ("1h", "not a Slurm time"),
])
def test_slurm_times_sbatch_would_refuse_or_misread(cli, time, message):
    for key in ("resources.time", "eval.time"):
        _assert_rejected(cli("validate", DEMO, f"{key}={time}"), "override", key, message)


ABSURD = [
    ("model.action_horizon=1000000000", "model.action_horizon", "at most 10000"),
    ("model.max_token_len=100000000", "model.max_token_len", "at most 1048576"),
    ("resources.nodes=100000000", "resources.nodes", "at most 1000000"),
    ("resources.gpus_per_node=1000", "resources.gpus_per_node", "at most 64"),
    ("resources.signal_delay_s=70000", "resources.signal_delay_s", "65535"),
    ("train.steps=2000000000", "train.steps", "at most 1000000000"),
    ("train.global_batch_size=1000000000", "train.global_batch_size", "at most 16777216"),
    ("eval.shards=5000000", "eval.shards", "MaxArraySize"),
    ("eval.image_size=100000", "eval.image_size", "at most 8192"),
    ("data.num_workers=100000", "data.num_workers", "at most 1024"),
]


@pytest.mark.parametrize(("override", "key", "message"), ABSURD, ids=[o for o, _, _ in ABSURD])
def test_absurd_sizes_are_refused_at_validate(cli, override, key, message):
    extra = {"resources.signal_delay_s": ["resources.time=3-00:00:00"],
             "eval.shards": ["eval.episodes_per_task=10000000"]}.get(key, [])
    _assert_rejected(cli("validate", DEMO, override, *extra), "override", key, message)


@pytest.mark.parametrize(("overrides", "warning"), [
    (["resources.nodes=100000", "train.global_batch_size=1600000"], "resources.nodes=100000"),
    (["eval.episodes_per_task=100000"], "200000 episodes"),
    (["eval.shards=2000", "eval.episodes_per_task=1000"], "eval.shards=2000"),
    (["resources.time=30-00:00:00"], "43200 minutes"),
    (["train.steps=50000000"], "train.steps=50000000"),
    (["train.lr=3"], "train.lr=3.0"),
])
def test_large_but_legal_values_warn_naming_the_number(cli, overrides, warning):
    result = cli("validate", DEMO, *overrides)
    assert result.code == 0, result.err
    lines = [line for line in result.err.splitlines() if line.startswith("warning: ")]
    assert len(lines) == 1 and warning in lines[0], result.err


def test_shipped_sizes_do_not_warn(cli):
    result = cli("validate", DEMO)
    assert result.code == 0 and "warning" not in result.err, result.err


def test_a_warmup_as_long_as_the_run_is_refused_for_a_policy(cli, tmp_path):
    """The schedule refuses warmup_steps >= steps at step 0 of the job: validate says so first."""
    _assert_rejected(cli("validate", DEMO, "data.format=lerobot", f"data.root={tmp_path}", "train.steps=20"),
                     "override 'train.steps=20'", "train.warmup_steps", "not below steps=20", "warmup_steps=2")
    assert cli("validate", DEMO, "train.steps=5").code == 0  # the synthetic stand-in has no schedule


def test_executing_more_actions_than_a_chunk_holds_is_refused(cli, tmp_path):
    _assert_rejected(cli("validate", DEMO, "data.format=lerobot", f"data.root={tmp_path}", "eval.execute_steps=11"),
                     "override 'eval.execute_steps=11'", "eval.execute_steps", "model.action_horizon")
