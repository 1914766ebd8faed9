"""Failed writes: one clear OSError naming the directory and the cause, without orbax's tracebacks."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import pytest

from jaxstrategy import checkpoint

_FILE_SIZE_LIMITED = textwrap.dedent(
    """
    import json, resource, signal, sys
    import jax.numpy as jnp
    import numpy as np
    from jaxstrategy import checkpoint

    directory = sys.argv[1]
    checkpoint.save(directory, {"w": jnp.zeros(4)}, step=0)
    # Writes past 1 MiB fail with EFBIG, as they would with ENOSPC on a full disk.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))
    big = {"w": jnp.asarray(np.random.default_rng(0).standard_normal(2**20, dtype=np.float32))}
    for step in (1, 2):
        try:
            if step == 1:
                checkpoint.save(directory, big, step=1)
            else:
                with checkpoint.Checkpointer(directory) as checkpointer:
                    checkpointer.save(2, big)  # Fails in the background, raises here at close.
            print(json.dumps(["saved", step]), flush=True)
        except Exception as error:
            print(json.dumps([type(error).__name__, getattr(error, "errno", None), str(error)]), flush=True)
    """
)


@pytest.mark.slow  # Starts processes.
def test_a_write_that_fails_midway_is_one_clear_error_without_tracebacks(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", _FILE_SIZE_LIMITED, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(lines) == 2, lines
    for step, (kind, code, message) in zip((1, 2), lines, strict=True):
        assert (kind, code) == ("OSError", errno.EFBIG), message
        assert message.startswith(
            f"[Errno 27] Checkpointer.save(): could not write step {step} to {tmp_path}: File too large "
            "(EFBIG). The file size limit (ulimit -f) stopped the write: raise it, or save elsewhere. "
            "(The error: "
        ), message
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["0"], "no unfinished save is left"
    assert checkpoint.restore(tmp_path)["w"].tolist() == [0.0] * 4


def test_a_file_where_the_directory_should_be_is_one_clear_error(tmp_path, capfd):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(
        NotADirectoryError,
        match=rf"(?s)Checkpointer\(\): could not create the directory {re.escape(str(blocker / 'ckpt'))}: "
        r"Not a directory \(ENOTDIR\).*A file stands where a directory is expected: move it",
    ):
        checkpoint.save(blocker / "ckpt", {"w": jnp.ones(1)})
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_is_one_clear_error(tmp_path, capfd):
    checkpoint.save(tmp_path, {"w": jnp.ones(1)})
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(
            PermissionError,
            match=rf"(?s)checkpoint\.save\(\): cannot lock {re.escape(str(tmp_path))} .*"
            r"Permission denied \(EACCES\).*change its permissions, or save elsewhere",
        ):
            checkpoint.save(tmp_path, {"w": jnp.zeros(1)})
        assert checkpoint.restore(tmp_path)["w"].tolist() == [1.0], "reading still works"
    finally:
        tmp_path.chmod(0o755)
    assert "Traceback" not in capfd.readouterr().err
