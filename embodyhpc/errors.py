"""Errors a user can act on.

`UserError` and its subclasses are bad input: the CLI prints them on one line and exits 2.
Anything else is a runtime failure (exit 1). Every exit code the project gives a meaning to is here (no torch).
Neither kind's message shows a credential a URI in it carried (`mask_credentials`).
"""

from __future__ import annotations

import re
import signal

SUCCESS_EXIT_CODE = 0
BAD_INPUT_EXIT_CODE = 2
"""A UserError: the input was wrong (a recipe key, an argument, a path); nothing was created, submitted or lost."""
FAILURE_EXIT_CODE = 1
"""A RunFailure or any other error: the input was fine and the work failed (a job, Slurm, a disk, a doctor check)."""
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT
"""Ctrl-C at the command line (the shell's convention); `status --watch` and `logs -f` leave the run alone."""
STOPPED_EXIT_CODE = 128 + signal.SIGTERM
"""A rank that stopped at a stop signal exits as a SIGTERM death would (Slurm then cancels or requeues the job)."""
REQUEUE_EXIT_CODE = 144
"""Exit status of every rank after a requeue: submitit's own "requeue me" code (its local executor restarts the
tasks on it); under Slurm the job's state is REQUEUED whatever the tasks return."""


class UserError(Exception):
    """Bad input. `where` names the file or override, `key` the recipe key, `fix` what to do."""

    exit_code = BAD_INPUT_EXIT_CODE

    def __init__(self, message: str, *, where: str | None = None, key: str | None = None,
                 fix: str | None = None, related: tuple[str, ...] = ()) -> None:
        self.message = message
        self.related = related  # other keys involved in a cross-section check
        self.where = where
        self.key = key
        self.fix = fix
        super().__init__(self.one_line())

    def one_line(self) -> str:
        parts = [p for p in (self.where, self.key) if p]
        text = ": ".join([*parts, self.message])
        if self.fix:
            text += f" (fix: {self.fix})"
        return mask_credentials(" ".join(text.split()))  # one line, always; no password a value carried


class ConfigError(UserError):
    """A recipe, site profile or override is wrong."""


class RunDirError(UserError):
    """A run directory is missing or not an embodyhpc run."""


class UnreadableRunError(RunDirError):
    """A run folder this user may not read: someone else's private run in a shared runs root."""


class RunFailure(RuntimeError):
    """A runtime failure the CLI reports on one line with exit code 1 (not bad input)."""

    exit_code = FAILURE_EXIT_CODE

    def __str__(self) -> str:  # a store's or a tool's message may quote a URI with its password
        return mask_credentials(super().__str__())


class SlurmError(RunFailure):
    """A Slurm command failed."""


# ---- no credential in a message ----
MASK = "***"
_SCHEME = re.compile(r"\b[A-Za-z][A-Za-z0-9+.\-]*://")
_URI_END = re.compile(r"[\s'\"<>`{}|\\^]")  # never in a URI (a raw '?', '#' or '/' may be in a typed password)
_QUERY_PARAM = re.compile(r"(?<=[?&;])([A-Za-z0-9_.\-]+)=([^&;#\s'\"<>]*)")
_SECRET_PARAM = re.compile(r"(?:^|[_.\-])(?:token|key|auth|sig)$|secret|passw|pwd|passphrase|credential|signature|"
                           r"apikey", re.IGNORECASE)
_TOKEN = re.compile(r"(?:ghp_|gho_|ghu_|ghs_|ghr_|github_pat_|glpat-|hf_|xox[abpr]-|sk-)\S+|"
                    r"(?=[\w-]*\d)(?=[\w-]*[A-Za-z])[\w-]{20,}")
"""An access token written as a URI's user name (https://ghp_...@github.com): a known prefix, or 20+ letters and
digits; a user name such as git, alice or first.last is not one."""


def uri_userinfo(text: str) -> tuple[int, int] | None:
    """Where the credential of the URI starting `text` (after `scheme://`) lies, as (start, end) offsets: the password
    of user:password@host (up to the URI's last '@', so a password holding '@', '/' or '?' is covered whole), or a
    token used as the user name; None when it carries none. A port or a path before an '@' (host:5000/pkg@1.0,
    host/a@b) is not a password."""
    end = _URI_END.search(text)
    run = text[:end.start()] if end else text
    at = run.rfind("@")
    if at < 0:
        return None
    userinfo = run[:at]
    colon = userinfo.find(":")
    if colon < 0:
        return (0, at) if "/" not in userinfo and _TOKEN.fullmatch(userinfo) else None
    rest = userinfo[colon + 1:]
    if "/" in userinfo[:colon] or ("/" in rest and rest.partition("/")[0].isdigit()):
        return None
    return colon + 1, at


def secret_param(name: str) -> bool:
    """A query parameter that carries a credential: token, access_token, api_key, password, sig (Azure SAS),
    X-Amz-Signature, X-Amz-Credential, X-Amz-Security-Token ..."""
    return bool(_SECRET_PARAM.search(re.sub(r"(?<=[a-z])(?=[A-Z])", "_", name)))


def mask_credentials(text: str) -> str:
    """`text` with every credential a URI in it carries replaced by ***: the password of scheme://user:password@host,
    a token used as the user name, and the value of a secret-looking query parameter (?token=..., &sig=...). Every
    error and warning embodyhpc prints passes through it: a value is often quoted back to its author."""
    if "://" not in text and "=" not in text:
        return text
    out, pos = [], 0
    for match in _SCHEME.finditer(text):
        if match.start() < pos:
            continue
        found = uri_userinfo(text[match.end():])
        if found is not None:
            start, stop = match.end() + found[0], match.end() + found[1]
            out.append(text[pos:start] + MASK)
            pos = stop
    out.append(text[pos:])
    masked = "".join(out)
    return _QUERY_PARAM.sub(lambda m: f"{m[1]}={MASK}" if m[2] and secret_param(m[1]) else m[0], masked)
