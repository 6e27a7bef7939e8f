"""Issue 16, class 2: previewing (render, submit --dry-run, validate) never runs code and never discloses files.

Templates render in Jinja's immutable sandbox and include only bare names from the template folders; the keys
that choose what code runs come only from a site profile; a file refused as a recipe is never echoed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from embodyhpc.config.load import shipped_recipes, shipped_sites
from embodyhpc.orchestrate.plan import kind_plan
from embodyhpc.slurm.render import JOB_KINDS, template_env
from embodyhpc.validation import load_recipe
from tests.helpers import one_line_error

DEMO = "smoke_cpu"
SECRET = "hunter2-SECRETHASH"


def _assert_rejected(result, *fragments: str) -> str:
    line = one_line_error(result, *fragments)
    return line


def _site_with_templates(tmp_path: Path, body: str, name: str = "train.sbatch.j2") -> Path:
    folder = tmp_path / "templates"
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(body)
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"site": {"templates_dir": str(folder)}}))
    return site


# what a template may try: run code through Python internals, mutate data, read files, exhaust memory
HOSTILE_TEMPLATES = [
    ("class walk", "{{ ''.__class__.__mro__[1].__subclasses__() }}"),
    ("globals of a helper", "{{ cycler.__init__.__globals__.os.popen('touch pwned').read() }}"),
    ("lipsum globals", "{{ lipsum.__globals__['os'].system('touch pwned') }}"),
    ("joiner globals", "{{ joiner.__init__.__globals__.__builtins__.__import__('os').system('touch pwned') }}"),
    ("str.format escape", "{{ '{0.__class__.__init__.__globals__}'.format(kind) }}"),
    ("namespace internals", "{% set ns = namespace() %}{{ ns.__init__.__globals__ }}"),
    ("mutating the context", "{% set _ = sbatch.extra_sbatch.update({'wrap': 'touch pwned'}) %}x"),
    ("mutating a list", "{% set _ = modules.append('evil') %}x"),
    ("func_globals of a filter", "{{ (kind|attr('__class__')).__base__.__subclasses__() }}"),
    ("huge range", "{{ range(10 ** 9) | list | length }}"),
    ("include an absolute path", '{% include "/etc/passwd" %}'),
    ("include a parent path", '{% include "../secret.j2" %}'),
    ("include a sub folder", '{% include "sub/x.sbatch.j2" %}'),
    ("extends an absolute path", '{% extends "/etc/hostname" %}'),
    ("import an absolute path", '{% import "/etc/passwd" as p %}x'),
    ("from-import an absolute path", '{% from "/etc/passwd" import x %}x'),
    ("include a non-template", '{% include "secret.txt" %}'),
]


@pytest.mark.parametrize("command", ["render", "dry-run", "validate"])
@pytest.mark.parametrize(("name", "body"), HOSTILE_TEMPLATES, ids=[n for n, _ in HOSTILE_TEMPLATES])
def test_hostile_template_is_refused_without_running_code(cli, tmp_path, monkeypatch, runs_root, command, name, body):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret.j2").write_text(SECRET)
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "secret.txt").write_text(SECRET)
    (tmp_path / "templates" / "sub").mkdir()
    (tmp_path / "templates" / "sub" / "x.sbatch.j2").write_text(SECRET)
    site = _site_with_templates(tmp_path, body)
    args = {"render": ["render", DEMO, "--job", "train"], "dry-run": ["submit", DEMO, "--dry-run"],
            "validate": ["validate", DEMO]}[command]
    result = cli(*args, "--site", str(site), f"job.runs_root={runs_root}")
    _assert_rejected(result, "train.sbatch.j2")
    assert not (tmp_path / "pwned").exists()
    everything = result.out + result.err
    assert SECRET not in everything and "root:x:0:0" not in everything
    assert list(runs_root.iterdir()) == []


def test_symlink_out_of_the_template_folder_is_refused(cli, tmp_path):
    secret = tmp_path / "outside.txt"
    secret.write_text(SECRET)
    site = _site_with_templates(tmp_path, '{% include "link.sbatch.j2" %}')
    (tmp_path / "templates" / "link.sbatch.j2").symlink_to(secret)
    result = cli("render", DEMO, "--job", "train", "--site", str(site))
    _assert_rejected(result, "link.sbatch.j2")
    assert SECRET not in result.out + result.err


def test_symlinked_template_file_itself_is_refused(cli, tmp_path):
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "train.sbatch.j2").symlink_to("/etc/passwd")
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"site": {"templates_dir": str(tmp_path / "templates")}}))
    result = cli("render", DEMO, "--job", "train", "--site", str(site))
    # the folder's train template is refused, so the shipped one renders: nothing of /etc/passwd is printed
    assert "root:x:0:0" not in result.out + result.err


def test_every_shipped_template_renders_in_the_sandbox(tmp_path):
    """The sandbox changes no shipped script (the golden files say the same byte for byte)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    assert isinstance(template_env(None), ImmutableSandboxedEnvironment)
    for recipe in shipped_recipes():
        for site in shipped_sites():
            loaded = load_recipe(recipe, ["site.account=me", "data.root=/data/x", "model.tokenizer_path=/t.model",
                                          "model.init_weights=/w"], site=site)
            for kind in JOB_KINDS:
                text = kind_plan(loaded, kind, tmp_path / "run", "/usr/bin/python3").jobs[0].script
                assert text.startswith("#!/bin/bash\n#SBATCH"), (recipe, site, kind)


def test_a_site_template_including_a_shipped_one_still_works(cli, tmp_path):
    site = _site_with_templates(
        tmp_path, '{% extends "base.sbatch.j2" %}\n{% block before_srun %}\necho from-site\n{% endblock %}\n')
    result = cli("render", DEMO, "--job", "train", "--site", str(site))
    assert result.code == 0, result.err
    assert "echo from-site" in result.out and "#SBATCH --signal=" in result.out


# ---------------------------------------------------------------- keys only a site profile may set

SITE_ONLY = [
    ("site.templates_dir", "/tmp"),
    ("site.python", "/tmp/evil/python"),
    ("site.container.image", "evil.sqsh"),
    ("site.container.mounts", "['/:/host']"),
    ("site.container.workdir", "/tmp"),
    ("site.container.extra_args", "['--container-env=LD_PRELOAD']"),
    ("site.modules", "[evil]"),
    ("site.env.LD_PRELOAD", "/tmp/evil.so"),
    ("site.env", "{BASH_ENV: /tmp/x}"),
    ("site.env.PATH", "/tmp/evil:/usr/bin"),
    ("site.env.TORCHINDUCTOR_CACHE_DIR", "/tmp/evil-kernels"),
    ("site.secrets", "[HF_TOKEN]"),
    ("site", "{python: /tmp/evil}"),
    ("site.container", "{image: evil.sqsh}"),
    ("network.extra_env.LD_PRELOAD", "/tmp/evil.so"),
    ("network.extra_env.PYTHONPATH", "/tmp/evil"),
    ("network.extra_env.PYTHONSTARTUP", "/tmp/evil.py"),
    ("network.extra_env.BASH_ENV", "/tmp/evil.sh"),
    ("network.extra_env.LD_LIBRARY_PATH", "/tmp/evil"),
    ("network.extra_env.NCCL_NET_PLUGIN", "evil"),
]


@pytest.mark.parametrize(("key", "value"), SITE_ONLY, ids=[k for k, _ in SITE_ONLY])
def test_code_choosing_key_from_an_override_is_refused(cli, key, value):
    line = _assert_rejected(cli("render", DEMO, f"{key}={value}"), "override", "site profile")
    assert "only a site profile may set it" in line


@pytest.mark.parametrize(("key", "value"), SITE_ONLY, ids=[k for k, _ in SITE_ONLY])
def test_code_choosing_key_from_a_recipe_is_refused(cli, tmp_path, key, value):
    data: dict = {}
    node = data
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = yaml.safe_load(value)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    _assert_rejected(cli("validate", str(recipe)), str(recipe), "site profile")


def test_code_choosing_key_from_a_base_recipe_is_refused(cli, tmp_path):
    (tmp_path / "base.yaml").write_text("site:\n  python: /tmp/evil\n")
    (tmp_path / "recipe.yaml").write_text("base: base.yaml\n")
    _assert_rejected(cli("validate", str(tmp_path / "recipe.yaml")), str(tmp_path / "base.yaml"), "site.python")


def test_code_choosing_keys_from_a_site_profile_are_accepted(cli, tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"site": {"python": "/opt/venv/bin/python", "modules": ["cuda/12"],
                                             "env": {"FOO": "bar"}, "container": {"image": "img.sqsh"}},
                                    "network": {"extra_env": {"LD_LIBRARY_PATH": "/opt/nccl"}}}))
    result = cli("render", DEMO, "--job", "train", "--site", str(site))
    assert result.code == 0, result.err
    assert "/opt/venv/bin/python" in result.out and "module load cuda/12" in result.out


def test_nccl_tuning_from_a_recipe_stays_allowed(cli):
    result = cli("render", DEMO, "--job", "train", "network.extra_env.NCCL_NSOCKS_PERTHREAD=4",
                 "site.env.OMP_NUM_THREADS=4")
    assert result.code == 0, result.err


def test_eval_of_handed_over_weights_drops_their_code_choosing_keys(tmp_path):
    """`embodyhpc eval --ckpt` reads the config next to someone's weights: its python, container and code-loading
    variables are dropped, and the site profile given now supplies them."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"site": {"python": "/tmp/evil/python", "env": {"LD_PRELOAD": "/tmp/e.so",
                                                                                     "OMP_NUM_THREADS": "2"},
                                               "container": {"image": "evil.sqsh"}},
                                      "network": {"extra_env": {"PYTHONPATH": "/tmp/evil"}}}))
    loaded = load_recipe(str(config), recipe_site_keys="drop")
    site = loaded.config.site
    assert site.python is None and site.container.image is None and dict(site.env) == {"OMP_NUM_THREADS": "2"}
    assert "PYTHONPATH" not in loaded.config.network.extra_env


# ---------------------------------------------------------------- refused files are never echoed

DISCLOSED_FILES = [
    ("shadow-like", f"root:$6${SECRET}:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n"),
    ("undefined alias", f"*{SECRET}\n"),
    ("unclosed flow", f"key: [{SECRET}\n"),
    ("tab", f"a:\n\t{SECRET}\n"),
    ("mapping of secrets", f"password: {SECRET}\nuser: admin\n"),
    ("scalar", f"{SECRET}\n"),
    ("bad indentation", f"a: b\n  c: {SECRET}\n d: e\n"),
    ("quoted", f"'{SECRET}\n"),
    ("section with a secret value", f"job: {SECRET}\n"),
    ("binary", None),
]


@pytest.mark.parametrize(("name", "text"), DISCLOSED_FILES, ids=[n for n, _ in DISCLOSED_FILES])
def test_refused_base_file_is_never_echoed(cli, tmp_path, name, text):
    target = tmp_path / "private"
    if text is None:
        target.write_bytes(b"\x00\xff" + SECRET.encode() + b"\xfe")
    else:
        target.write_text(text)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"base: {target}\n")
    for command in ("validate", "render"):
        result = cli(command, str(recipe))
        assert result.code == 2, result.err
        assert SECRET not in result.out + result.err, result.err


def test_real_system_files_as_base_are_not_echoed(cli, tmp_path):
    for system_file in ("/etc/passwd", "/etc/shadow", "/etc/group"):
        if not Path(system_file).is_file():
            continue
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(f"base: {system_file}\n")
        result = cli("validate", str(recipe))
        assert result.code == 2
        first = Path(system_file).read_text(errors="replace").splitlines()[0]
        assert first not in result.err and "root:" not in result.err, result.err


@pytest.mark.parametrize("target", ["/proc/self/environ", "/proc/self/cmdline"])
def test_proc_files_as_base_are_not_echoed(cli, tmp_path, monkeypatch, target):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"base: {target}\n")
    result = cli("validate", str(recipe))
    _assert_rejected(result, target)
    assert SECRET not in result.out + result.err


@pytest.mark.parametrize("target", ["/etc/passwd", "/etc/group"])
def test_system_file_as_site_profile_is_not_echoed(cli, target):
    result = cli("validate", DEMO, "--site", target)
    _assert_rejected(result, target)
    assert "root:" not in result.err
