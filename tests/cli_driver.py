"""Run several `embodyhpc` command lines through the real entry point in one process (one interpreter start for
many commands), each with a strict UTF-8 stdout and stderr as an en_US.UTF-8 terminal has; print one JSON list of
{"code", "out", "err"}. A test starts it as another user (tests/test_shared_root.py): the commands then meet the
filesystem's permissions for real.

    python tests/cli_driver.py COMMANDS.json     # a JSON list of argument lists
"""

from __future__ import annotations

import io
import json
import sys
import traceback


def run(argv: list[str]) -> dict:
    from embodyhpc.cli.main import main

    out, err = io.BytesIO(), io.BytesIO()
    sys.stdout = io.TextIOWrapper(out, encoding="utf-8", errors="strict", write_through=True)
    sys.stderr = io.TextIOWrapper(err, encoding="utf-8", errors="strict", write_through=True)
    sys.argv = ["embodyhpc", *argv]
    try:
        main()
        code: int | str = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - what the user would see: a traceback
        traceback.print_exc(file=sys.stderr)
        code = "traceback"
    sys.stdout.flush()
    sys.stderr.flush()
    return {"code": code, "out": out.getvalue().decode("utf-8", "backslashreplace"),
            "err": err.getvalue().decode("utf-8", "backslashreplace")}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        commands = json.load(f)
    results = [run(argv) for argv in commands]
    sys.__stdout__.write(json.dumps(results))
