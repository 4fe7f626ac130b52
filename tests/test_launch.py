"""labutils.launch.forked_runs: one process per job, forked from one that only imported."""
import os

import pytest

from labutils import launch


def test_forked_runs_return_each_jobs_result_in_order():
    results = launch.forked_runs("json:dumps", [{"obj": [1, 2]}, {"obj": {"a": 3}}])
    assert results == ["[1, 2]", '{"a": 3}']
    pids = launch.forked_runs("os:getpid", [{}, {}])
    assert len(set(pids)) == 2 and os.getpid() not in pids  # a process of its own per job


def test_forked_runs_report_a_failing_job():
    with pytest.raises(RuntimeError, match="failed in a forked process"):
        launch.forked_runs("json:loads", [{"s": "not json"}])
