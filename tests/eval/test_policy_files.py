"""The side files an evaluation feeds the trained policy with (policy_io.json, normalization.json), checked on their
own and against the weights' recipe and the evaluation's suite: each problem is one line naming the file, the field
and the fix."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from embodyhpc.config.schema import EvalConfig, ModelConfig
from embodyhpc.errors import UserError
from embodyhpc.eval import suites
from embodyhpc.eval.policy_files import SIDE_FILES, PolicyFiles, check_policy_files, check_suite, find_side_files
from embodyhpc.eval.suites import register_suite

# the demo recipe's model: MetaWorld's 39-dim environment state, normalised, 4 real action dims
MODEL = ModelConfig(action_horizon=10, action_dim=4, state_key="observation.environment_state", state_input="expert",
                    state_dim=40, state_norm="mean_std")
IO = {"cameras": ["corner"], "image_size": 64, "state_key": "observation.environment_state", "action_dim": 4,
      "fps": 80}
NORM = {"key": "observation.environment_state", "mode": "mean_std", "offset": [0.0] * 39, "scale": [1.0] * 39}


def _folder(tmp_path, io=IO, norm=NORM):
    for name, content in (("policy_io.json", io), ("normalization.json", norm)):
        if content is not None:
            (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return find_side_files([tmp_path])


def test_what_training_writes_passes(tmp_path):
    policy = check_policy_files(_folder(tmp_path), MODEL, where=str(tmp_path))
    assert (policy.cameras, policy.image_size, policy.action_dim) == (("corner",), 64, 4)
    assert policy.normalizer.mode == "mean_std" and len(policy.normalizer.offset) == 39


def test_no_side_files_is_a_state_only_policy_when_the_recipe_does_not_normalise(tmp_path):
    policy = check_policy_files(_folder(tmp_path, io=None, norm=None), dataclasses.replace(MODEL, state_norm="none"),
                                where=str(tmp_path))
    assert policy.cameras == () and policy.action_dim is None and policy.normalizer.mode == "none"


def test_side_files_are_found_in_the_first_folder_that_has_each(tmp_path):
    first, second = tmp_path / "checkpoints", tmp_path / "export"
    first.mkdir()
    second.mkdir()
    (second / "policy_io.json").write_text("{}")
    (second / "normalization.json").write_text("{}")
    (first / "normalization.json").write_text("{}")
    found = find_side_files([first, second])
    assert set(found) == set(SIDE_FILES)
    assert found["normalization.json"] == first / "normalization.json"
    assert found["policy_io.json"] == second / "policy_io.json" and found["tokenizer.model"] is None


# (case, policy_io.json content, the field in the message, what it says)
BAD_IO = [
    ("not-json", "{", None, "unreadable"),
    ("a-list", "[]", None, "not a JSON object"),
    ("cameras-a-string", {**IO, "cameras": "corner"}, "cameras", "not a list of camera names"),
    ("cameras-of-numbers", {**IO, "cameras": [1]}, "cameras", "not a list of camera names"),
    ("camera-empty-name", {**IO, "cameras": [""]}, "cameras", "not a list of camera names"),
    ("camera-a-path", {**IO, "cameras": ["../x"]}, "cameras", "not a list of camera names"),
    ("camera-twice", {**IO, "cameras": ["corner", "corner"]}, "cameras", "listed twice"),
    ("image-size-zero", {**IO, "image_size": 0}, "image_size", "not a positive integer"),
    ("image-size-text", {**IO, "image_size": "64"}, "image_size", "not a positive integer"),
    ("image-size-float", {**IO, "image_size": 64.5}, "image_size", "not a positive integer"),
    ("action-dim-bool", {**IO, "action_dim": True}, "action_dim", "not a positive integer"),
    ("action-dim-negative", {**IO, "action_dim": -4}, "action_dim", "not a positive integer"),
    ("fps-zero", {**IO, "fps": 0}, "fps", "not a frame rate"),
    ("fps-text", {**IO, "fps": "80"}, "fps", "not a frame rate"),
    # contradicting the weights' recipe
    ("more-action-dims-than-the-model", {**IO, "action_dim": 7}, "action_dim",
     "the weights predict model.action_dim=4"),
    ("another-state-key", {**IO, "state_key": "observation.state"}, "state_key", "model.state_key="),
]


@pytest.mark.parametrize(("case", "io", "key", "expected"), BAD_IO, ids=[c[0] for c in BAD_IO])
def test_a_bad_policy_io_is_one_line(tmp_path, case, io, key, expected):
    with pytest.raises(UserError, match=re.escape(expected)) as caught:
        check_policy_files(_folder(tmp_path, io=io), MODEL, where=str(tmp_path))
    line = caught.value.one_line()
    assert str(tmp_path / "policy_io.json") in line and "\n" not in line and "fix:" in line
    assert key is None or f": {key}: " in line


BAD_NORM = [
    ("nan", {**NORM, "offset": [float("nan")] + [0.0] * 38}, "offset[0]: nan is not finite"),
    ("another-mode", {**NORM, "mode": "quantile"}, "statistics for quantile"),
    ("another-state", {**NORM, "key": "observation.state"}, "statistics of 'observation.state'"),
    ("more-dims-than-the-model-takes", {**NORM, "offset": [0.0] * 41, "scale": [1.0] * 41},
     "model takes model.state_dim=40"),
    ("mode-none-where-the-recipe-normalises", {"key": NORM["key"], "mode": "none", "offset": [], "scale": []},
     "statistics for none"),
]


@pytest.mark.parametrize(("case", "norm", "expected"), BAD_NORM, ids=[c[0] for c in BAD_NORM])
def test_statistics_that_contradict_the_recipe_are_refused(tmp_path, case, norm, expected):
    with pytest.raises(UserError, match=re.escape(expected)) as caught:
        check_policy_files(_folder(tmp_path, norm=norm), MODEL, where=str(tmp_path))
    assert str(tmp_path / "normalization.json") in caught.value.one_line()


def test_missing_statistics_where_the_recipe_normalises_are_refused(tmp_path):
    with pytest.raises(UserError, match="model.state_norm=mean_std, and no normalization.json") as caught:
        check_policy_files(_folder(tmp_path, norm=None), MODEL, where=str(tmp_path))
    assert caught.value.one_line().startswith(f"{tmp_path}: ")


# --- the suite -----------------------------------------------------------------------------------------------


def _policy(cameras=("corner",), action_dim=4):
    return PolicyFiles(normalizer=None, cameras=tuple(cameras), image_size=64, action_dim=action_dim)


def _eval(suite, tasks, **options):
    return EvalConfig(suite=suite, tasks=tasks, suite_options=options, shards=1)


def test_the_suite_the_policy_was_trained_in_passes():
    check_suite(_policy(), MODEL, _eval("metaworld", ["reach-v3"]), where="w")
    check_suite(_policy(cameras=["corner2", "gripperPOV"]), MODEL,
                _eval("metaworld", ["reach-v3"], video_camera="topview"), where="w")
    check_suite(_policy(cameras=["top"], action_dim=2), MODEL, _eval("pusht", ["pusht"]), where="w")
    check_suite(_policy(cameras=["image", "wrist_image"], action_dim=7), dataclasses.replace(MODEL, action_dim=32),
                _eval("libero", ["libero_spatial"]), where="w")


SUITE_MISMATCH = [
    ("camera-the-suite-lacks", _policy(cameras=["corner", "wrist"]), {}, "metaworld",
     "camera 'wrist', which the metaworld suite does not render"),
    ("metaworld-policy-on-pusht", _policy(), {}, "pusht", "camera 'corner', which the pusht suite does not render"),
    ("state-only-policy-on-pusht", _policy(cameras=[]), {}, "pusht", "acts in 4 dims"),
    ("libero-policy-on-metaworld", _policy(cameras=["image"], action_dim=7), {}, "metaworld",
     "camera 'image', which the metaworld suite does not render"),
    ("video-camera-the-suite-lacks", _policy(), {"video_camera": "nosuch"}, "metaworld",
     "'nosuch' is not a camera of the metaworld suite"),
]
TASKS = {"metaworld": ["reach-v3"], "pusht": ["pusht"], "libero": ["libero_spatial"]}


@pytest.mark.parametrize(("case", "policy", "options", "suite", "expected"), SUITE_MISMATCH,
                         ids=[c[0] for c in SUITE_MISMATCH])
def test_a_suite_that_cannot_feed_the_policy_is_refused(case, policy, options, suite, expected):
    with pytest.raises(UserError, match=re.escape(expected)) as caught:
        check_suite(policy, MODEL, _eval(suite, TASKS[suite], **options), where="/w")
    assert "\n" not in caught.value.one_line() and "fix:" in caught.value.one_line()


def test_a_policy_without_action_dims_acts_in_the_model_s(tmp_path):
    """An export without policy_io.json (older runs): the policy acts in model.action_dim dims."""
    with pytest.raises(UserError, match="acts in 32 dims"):
        check_suite(_policy(cameras=[], action_dim=None), dataclasses.replace(MODEL, action_dim=32),
                    _eval("metaworld", ["reach-v3"]), where="w")


class SiteSuite:
    """A site's suite that says which cameras it renders and what its actions are."""

    camera_names = ("front", "wrist")
    action_dim = 6

    def __init__(self, tasks, *, cameras=(), image_size=64):
        pass


class QuietSuite:
    """A site's suite that says nothing: nothing is checked."""

    def __init__(self, tasks, *, cameras=(), image_size=64):
        pass


def test_a_registered_suite_is_checked_by_what_it_declares(monkeypatch):
    monkeypatch.setattr(suites, "_REGISTRY", dict(suites._REGISTRY))  # the registrations end with the test
    register_suite("test-site-suite", SiteSuite)
    register_suite("test-quiet-suite", QuietSuite)
    check_suite(_policy(cameras=["front"], action_dim=6), MODEL, _eval("test-site-suite", ["any"]), where="w")
    with pytest.raises(UserError, match="camera 'corner', which the test-site-suite suite does not render"):
        check_suite(_policy(), MODEL, _eval("test-site-suite", ["any"]), where="w")
    with pytest.raises(UserError, match="the test-site-suite suite takes 6"):
        check_suite(_policy(cameras=["wrist"], action_dim=4), MODEL, _eval("test-site-suite", ["any"]), where="w")
    check_suite(_policy(cameras=["anything"], action_dim=3), MODEL, _eval("test-quiet-suite", ["any"]), where="w")
