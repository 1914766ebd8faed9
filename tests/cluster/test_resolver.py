"""Cluster resolvers: TF_CONFIG read as TensorFlow documents it, and JAX's three facts."""

from __future__ import annotations

import json

import pytest

from jaxstrategy import SimpleClusterResolver, TFConfigClusterResolver

WORKERS = ["10.0.0.1:2222", "10.0.0.2:2222", "10.0.0.3:2222"]


def tf_config(monkeypatch, config) -> TFConfigClusterResolver:
    monkeypatch.setenv("TF_CONFIG", config if isinstance(config, str) else json.dumps(config))
    return TFConfigClusterResolver()


def facts(resolver) -> tuple:
    return (
        resolver.task_type,
        resolver.task_id,
        resolver.process_id,
        resolver.num_processes,
        resolver.coordinator_address,
    )


@pytest.mark.parametrize("index", [0, 1, 2])
def test_workers_are_processes_in_order_and_the_first_is_the_coordinator(monkeypatch, index):
    resolver = tf_config(
        monkeypatch, {"cluster": {"worker": WORKERS}, "task": {"type": "worker", "index": index}}
    )
    assert facts(resolver) == ("worker", index, index, 3, WORKERS[0])
    assert resolver.cluster_spec() == {"worker": WORKERS}


def test_a_chief_is_process_0_and_the_coordinator(monkeypatch):
    cluster = {"chief": ["10.0.0.9:2222"], "worker": WORKERS}
    chief = tf_config(monkeypatch, {"cluster": cluster, "task": {"type": "chief", "index": 0}})
    assert facts(chief) == ("chief", 0, 0, 4, "10.0.0.9:2222")
    worker = tf_config(monkeypatch, {"cluster": cluster, "task": {"type": "worker", "index": 2}})
    assert facts(worker) == ("worker", 2, 3, 4, "10.0.0.9:2222")


def test_the_spec_example_lists_ps_tasks_which_do_not_train(monkeypatch):
    config = {
        "cluster": {"worker": ["localhost:12345", "localhost:23456"], "ps": ["localhost:34567"]},
        "task": {"type": "worker", "index": 0},
    }
    resolver = tf_config(monkeypatch, config)
    assert facts(resolver) == ("worker", 0, 0, 2, "localhost:12345")
    assert resolver.cluster_spec() == config["cluster"]


def test_an_evaluator_is_a_job_of_one(monkeypatch):
    resolver = tf_config(
        monkeypatch, {"cluster": {"worker": WORKERS}, "task": {"type": "evaluator", "index": 0}}
    )
    assert facts(resolver) == ("evaluator", 0, 0, 1, None)


def test_a_job_of_one_worker_has_no_coordinator_to_start(monkeypatch):
    resolver = tf_config(
        monkeypatch, {"cluster": {"worker": WORKERS[:1]}, "task": {"type": "worker", "index": 0}}
    )
    assert facts(resolver) == ("worker", 0, 0, 1, None)


def test_arguments_override_the_task(monkeypatch):
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": {"worker": WORKERS}, "task": {"type": "worker", "index": 0}})
    )
    assert facts(TFConfigClusterResolver(task_id=2))[:3] == ("worker", 2, 2)


def test_the_task_index_defaults_to_0(monkeypatch):
    assert tf_config(monkeypatch, {"cluster": {"worker": WORKERS}, "task": {"type": "worker"}}).task_id == 0


def test_an_unset_tf_config_says_what_to_set(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match=r"the TF_CONFIG environment variable is not set") as err:
        TFConfigClusterResolver()
    assert "Set it in every process" in str(err.value)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('{"cluster": ', r"TF_CONFIG is not valid JSON \(Expecting value: line 1 column 13"),
        ("[1, 2]", r"TF_CONFIG is a JSON list, not an object"),
        ({"task": {"type": "worker"}}, r"TF_CONFIG has no 'cluster' object"),
        (
            {"cluster": {"gpu": WORKERS}},
            r"names job\(s\) \['gpu'\] in its cluster; MultiWorkerMirroredStrategy knows",
        ),
        (
            {"cluster": {"worker": "10.0.0.1:2222"}},
            r"has cluster\['worker'\] = '10.0.0.1:2222', which is not a list",
        ),
        (
            {"cluster": {"worker": ["10.0.0.1"]}},
            r"has cluster\['worker'\]\[0\] = '10.0.0.1', and it has no port",
        ),
        ({"cluster": {"worker": ["h:99999"]}}, r"its port '99999' is not a number from 1 to 65535"),
        ({"cluster": {"worker": [7]}}, r"= 7, and it is a int, not a string"),
        ({"cluster": {"worker": ["h:1", "h:1"]}}, r"lists 'h:1' twice \(as worker:0 and worker:1\)"),
        (
            {"cluster": {"chief": ["a:1", "b:1"], "worker": ["c:1"]}},
            r"lists 2 chiefs; a cluster has at most one",
        ),
        ({"cluster": {"ps": ["a:1"]}}, r"has no 'chief' or 'worker' job, so no process would train"),
        ({"cluster": {"worker": WORKERS}, "task": []}, r"has a 'task' that is a list, not an object"),
        (
            {"cluster": {"worker": WORKERS}, "task": {"type": "master"}},
            r"has task type 'master', which is none of",
        ),
        (
            {"cluster": {"worker": WORKERS}, "task": {"type": "worker", "index": 3}},
            r"the cluster lists 3 worker task\(s\)",
        ),
        (
            {"cluster": {"worker": WORKERS}, "task": {"type": "worker", "index": "0"}},
            r"has task index '0', which is not an int",
        ),
        ({"cluster": {"worker": WORKERS}, "task": {"type": "chief"}}, r"the cluster lists 0 chief task\(s\)"),
    ],
)
def test_a_malformed_tf_config_names_the_part_and_shows_an_example(monkeypatch, config, message):
    with pytest.raises(ValueError, match=message) as info:
        tf_config(monkeypatch, config)
    assert "A valid one looks like" in str(info.value)


def test_a_ps_task_cannot_run_the_strategy(monkeypatch):
    config = {"cluster": {"worker": WORKERS, "ps": ["p:1"]}, "task": {"type": "ps", "index": 0}}
    with pytest.raises(
        ValueError,
        match=r"makes this process a 'ps' task, but MultiWorkerMirroredStrategy has no parameter servers",
    ):
        tf_config(monkeypatch, config)


def test_simple_resolver_holds_jax_s_three_facts():
    resolver = SimpleClusterResolver("10.0.0.1:1234", num_processes=4, process_id=3)
    assert facts(resolver) == ("worker", 3, 3, 4, "10.0.0.1:1234")
    assert resolver.cluster_spec() == {}
    assert facts(SimpleClusterResolver(None, 1, 0)) == ("worker", 0, 0, 1, None)


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (("h:1", 2, 2), ValueError, r"expected num_processes >= 1 and 0 <= process_id < num_processes"),
        (("h:1", 0, 0), ValueError, r"expected num_processes >= 1"),
        (("h:1", 2.0, 0), TypeError, r"SimpleClusterResolver\(num_processes=2.0\): expected an int"),
        (("h:1", 2, True), TypeError, r"SimpleClusterResolver\(process_id=True\): expected an int"),
        ((None, 2, 0), ValueError, r"a job of several processes needs the coordinator's 'host:port'"),
        (
            ("10.0.0.1", 2, 0),
            ValueError,
            r"coordinator_address='10.0.0.1'\): it has no port; expected 'host:port'",
        ),
    ],
)
def test_simple_resolver_rejects_bad_facts(args, error, message):
    with pytest.raises(error, match=message):
        SimpleClusterResolver(*args)


def test_num_accelerators_counts_this_process_s_accelerators():
    assert SimpleClusterResolver(None, 1, 0).num_accelerators() == {}  # CPU devices are not counted.


def test_master_is_a_task_s_address_as_in_tensorflow(monkeypatch):
    resolver = tf_config(
        monkeypatch,
        {"cluster": {"chief": ["10.0.0.9:2222"], "worker": WORKERS}, "task": {"type": "worker", "index": 1}},
    )
    assert resolver.master() == "10.0.0.2:2222"
    assert resolver.master("chief", 0, rpc_layer="grpc") == "grpc://10.0.0.9:2222"
    assert resolver.master("worker", 7) == "" and resolver.master("ps", 0) == ""
    coordinator = SimpleClusterResolver("10.0.0.1:1234", num_processes=2, process_id=0)
    assert (coordinator.master(), coordinator.master("worker", 1)) == ("10.0.0.1:1234", "")
    assert SimpleClusterResolver(None, num_processes=1, process_id=0).master() == ""
