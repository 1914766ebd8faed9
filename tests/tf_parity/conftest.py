"""Fixtures of the TF parity suite.

- `distribution`: the strategy of a `combinations.NamedDistribution` param (TF's `distribution`
  or `strategy` combination argument), built fresh for each test.
- `two_process_case`: a case of two_process_worker.py, i.e. one TF test on TF's two-process
  combination `multi_worker_mirrored_2x1_cpu`. Every module of this directory that defines
  `TF_FILE` and a test taking `two_process_case` gets one test per case of its TF file.

The jobs of two_process_worker.py (each a real job of two processes, started with
`jaxstrategy.testing.run_local_workers`) run once per session, in a background thread that starts
with the first test of this directory, so that they overlap the in-process tests; a case's test
waits for its job. Each job has a hard timeout, after which its processes are killed. Under
pytest-xdist (`make test`) the root conftest.py sends every test of this directory to one
worker, so that the jobs run once.
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from jaxstrategy._src.cluster.local_workers import describe_results
from jaxstrategy.testing import run_local_workers
from tf_parity import two_process_worker as worker

WORKER = Path(worker.__file__).resolve()
JOB_TIMEOUT_S = 240  # The main job takes 5-10 s alone; the cores are shared with the tests.
_NEEDED_JOBS = pytest.StashKey[set[str]]()


@pytest.fixture
def distribution(request: pytest.FixtureRequest) -> Any:
    return request.param.make()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "two_process_case" not in metafunc.fixturenames:
        return
    tf_file = metafunc.module.TF_FILE
    params = [
        pytest.param(
            case_id,
            id=case.name,
            # Slow: the test waits for a job of two processes (`make test-fast` runs none).
            marks=[
                pytest.mark.slow,
                *([pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []),
            ],
        )
        for case_id, case in worker.CASES.items()
        if case.tf_file == tf_file
    ]
    assert params, f"two_process_worker.py has no case of {tf_file}"
    metafunc.parametrize("two_process_case", params, indirect=True)


@pytest.hookimpl(trylast=True)  # After -k and -m have deselected what will not run.
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[_NEEDED_JOBS] = {
        worker.CASES[item.callspec.params["two_process_case"]].job
        for item in items
        if hasattr(item, "callspec") and "two_process_case" in item.callspec.params
    }


class TwoProcessJobs:
    """Runs each needed job of two_process_worker.py once, one after the other (two processes at a
    time on this machine's cores), in a background thread."""

    def __init__(self, directory: Path, jobs: set[str]):
        self._directory = directory
        self._outcomes: dict[str, list[subprocess.CompletedProcess[str]] | BaseException] = {}
        self._ended = {job: threading.Event() for job in worker.JOBS if job in jobs}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for job, ended in self._ended.items():
            try:
                self._outcomes[job] = run_local_workers(
                    [str(WORKER), str(self._directory), job],
                    num_workers=2,
                    devices_per_worker=1,
                    timeout=JOB_TIMEOUT_S,
                )
            except BaseException as error:  # A TimeoutError names what each process printed.
                self._outcomes[job] = error
            ended.set()

    def join(self) -> None:
        self._thread.join(len(self._ended) * (JOB_TIMEOUT_S + 30))

    def check(self, case_id: str) -> None:
        """Fail unless both processes ran `case_id` and it passed in both."""
        job = worker.CASES[case_id].job
        self._ended[job].wait(len(self._ended) * (JOB_TIMEOUT_S + 30))
        outcome = self._outcomes.get(job, RuntimeError(f"job {job!r} did not end"))
        about_job = str(outcome) if isinstance(outcome, BaseException) else describe_results(outcome)
        failures = []
        for index, role in enumerate(("chief", "worker")):
            path = self._directory / f"{job}-process-{index}.json"
            seen = json.loads(path.read_text()).get(case_id) if path.exists() else None
            if seen is None:
                failures.append(f"process {index} ({role}) did not report this case; the job:\n{about_job}")
            elif not seen["ok"]:
                failures.append(f"process {index} ({role}):\n{seen['error']}")
        if failures:
            pytest.fail("\n".join(failures), pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def two_process_jobs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    jobs = TwoProcessJobs(
        tmp_path_factory.mktemp("two_process"), request.config.stash.get(_NEEDED_JOBS, set())
    )
    yield jobs
    jobs.join()  # No worker outlives the session.


class _Case:
    def __init__(self, case_id: str, jobs: TwoProcessJobs):
        self.case_id = case_id
        self._jobs = jobs

    def check(self) -> None:
        self._jobs.check(self.case_id)


@pytest.fixture
def two_process_case(request: pytest.FixtureRequest, two_process_jobs: TwoProcessJobs) -> _Case:
    return _Case(request.param, two_process_jobs)
