"""redact() and redact_override(): what MLflow, run listings and error lines show of a config and of its overrides,
against outputs written out by hand from the decided rules (embodyhpc.config.credentials):

- a variable of site.env / network.extra_env whose name looks secret (HF_TOKEN), or a secret-looking key outside
  the schema, shows *** whatever its value holds (`=`, a number, a list, a mapping; booleans and empty values say
  nothing and stay);
- a schema field or an option name of the schema's own mappings (model.state_key, eval.suite_options.api_key) is an
  ordinary setting whatever its name ends in, and so is a variable whose name only contains a secret word;
- a URI's credential is masked in any value; text that holds no URI is no query string and stays as written.
"""

from __future__ import annotations

import copy

import pytest

from embodyhpc.config.credentials import redact, redact_override

SECRET = "hf_sekrit_value_0123456789"

CONFIG = {
    "job": {"name": "token-key-secret"},
    "model": {"state_key": "observation.state", "max_token_len": 96, "tokenizer_path": "/t/tok.model"},
    "site": {"env": {"HF_TOKEN": f"{SECRET}=b==", "OMP_NUM_THREADS": "4", "URL": "http://u:pw@h/x?token=t&page=2",
                     "EMPTY_TOKEN": "", "MASKED_TOKEN": "***", "TOKENIZERS_PARALLELISM": "false"},
             "extra_sbatch": {"comment": "a;key=1"},
             "modules": ["cuda/12", f"https://h/m?token={SECRET}"]},
    "network": {"extra_env": {"NCCL_IB_PKEY": "0x8001", "WANDB_API_KEY": SECRET}},
    "eval": {"suite_options": {"api_key": "plain-option"}},
    "custom": {"api_key": 123456, "credentials": {"user": "alice", "pass": SECRET, "port": 5432},
               "tokens": ["x"], "db_password": [SECRET, "p2"], "use_token": True, "old_token": None},
}
SHOWN = {
    "job": {"name": "token-key-secret"},
    "model": {"state_key": "observation.state", "max_token_len": 96, "tokenizer_path": "/t/tok.model"},
    "site": {"env": {"HF_TOKEN": "***", "OMP_NUM_THREADS": "4", "URL": "http://u:***@h/x?token=***&page=2",
                     "EMPTY_TOKEN": "", "MASKED_TOKEN": "***", "TOKENIZERS_PARALLELISM": "false"},
             "extra_sbatch": {"comment": "a;key=1"},
             "modules": ["cuda/12", "https://h/m?token=***"]},
    "network": {"extra_env": {"NCCL_IB_PKEY": "0x8001", "WANDB_API_KEY": "***"}},
    "eval": {"suite_options": {"api_key": "plain-option"}},
    "custom": {"api_key": "***", "credentials": {"user": "***", "pass": "***", "port": "***"},
               "tokens": ["x"], "db_password": ["***", "***"], "use_token": True, "old_token": None},
}


def test_redact_a_config():
    original = copy.deepcopy(CONFIG)
    assert redact(CONFIG) == SHOWN
    assert CONFIG == original  # a copy: the config itself is untouched
    assert redact(SHOWN) == SHOWN  # masked once is masked: nothing changes on a second pass


def test_redact_under_a_prefix_and_plain_values():
    assert redact({"HF_TOKEN": "x", "OMP_NUM_THREADS": "2"}, "site.env") == {"HF_TOKEN": "***", "OMP_NUM_THREADS": "2"}
    assert redact(("http://u:pw@h", "a;key=1", 3)) == ["http://u:***@h", "a;key=1", 3]
    assert redact("http://u:pw@h") == "http://u:***@h" and redact(7) == 7 and redact(None) is None


OVERRIDES = [  # (override, what is shown), derived by hand from the rules above
    ("site.env.HF_TOKEN=hf_a=b==", "site.env.HF_TOKEN=***"),  # the value holds '=': all of it goes
    ("network.extra_env.MY_PASSWORD=x=y", "network.extra_env.MY_PASSWORD=***"),
    ("site.env.HF_TOKEN=***", "site.env.HF_TOKEN=***"),  # already masked
    ("site.env.HF_TOKEN=", "site.env.HF_TOKEN="),  # nothing to hide
    ("site.env.HF_TOKEN", "site.env.HF_TOKEN"),  # no value at all
    ("custom.api_key=12345", "custom.api_key=***"),  # outside the schema
    ("model.state_key=observation.state", "model.state_key=observation.state"),
    ("model.max_token_len=96", "model.max_token_len=96"),
    ("eval.suite_options.api_key=plain", "eval.suite_options.api_key=plain"),  # a suite's option name
    ("site.env.TOKENIZERS_PARALLELISM=false", "site.env.TOKENIZERS_PARALLELISM=false"),  # contains, not is, a word
    ("network.extra_env.NCCL_IB_PKEY=0x8001", "network.extra_env.NCCL_IB_PKEY=0x8001"),
    ("job.name=token-key-secret", "job.name=token-key-secret"),
    ("site.extra_sbatch.comment=a;key=1", "site.extra_sbatch.comment=a;key=1"),  # no URI, no query string
    ("tracking.mlflow_uri=http://a:pw@h:5000/x?token=t", "tracking.mlflow_uri=http://a:***@h:5000/x?token=***"),
    ("site.env.DATA_URL=https://u:p=w@h/x", "site.env.DATA_URL=https://u:***@h/x"),
    ("=value", "=value"),
    # a mapping or list given whole: its secret variables' values go, as JSON; nothing secret: as written
    (f"network.extra_env={{HF_TOKEN: {SECRET}, OMP_NUM_THREADS: '4'}}",
     'network.extra_env={"HF_TOKEN": "***", "OMP_NUM_THREADS": "4"}'),
    (f"site={{env: {{WANDB_API_KEY: {SECRET}}}, partition: gpu}}", 'site={"env": {"WANDB_API_KEY": "***"}, '
                                                                   '"partition": "gpu"}'),
    ("network.extra_env={NCCL_IB_PKEY: '0x8001'}", "network.extra_env={NCCL_IB_PKEY: '0x8001'}"),
    ("site.env={URL: 'http://u:pw@h'}", "site.env={URL: 'http://u:***@h'}"),
    (f"network.extra_env={{HF_TOKEN: [{SECRET}", "network.extra_env=***"),  # does not parse, names a secret
    ("site.modules=[a, b]", "site.modules=[a, b]"),
]


@pytest.mark.parametrize(("override", "shown"), OVERRIDES, ids=[o[:40] for o, _ in OVERRIDES])
def test_redact_override(override, shown):
    assert redact_override(override) == shown


def test_params_mask_a_secret_keys_value_whatever_its_type():
    from embodyhpc.tracking.mlflow_values import flatten_params

    params = flatten_params({"custom": {"api_key": 123456, "credentials": {"user": "a", "pass": SECRET},
                                        "db_password": [SECRET], "use_token": True},
                             "site": {"env": {"HF_TOKEN": SECRET, "EMPTY_TOKEN": ""}}})
    assert params == {"custom.api_key": "***", "custom.credentials": "***", "custom.db_password": "***",
                      "custom.use_token": "True", "site.env.HF_TOKEN": "***", "site.env.EMPTY_TOKEN": ""}
