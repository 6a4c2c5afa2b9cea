"""cluster.yaml and serve_config.yaml against Ray's own validators, and the app they name, built without Ray."""
import copy
from pathlib import Path

import jsonschema
import pydantic
import pytest
import ray
import yaml
from ray._common.utils import import_attr
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve._private.build_app import build_app as serve_build_app
from ray.serve.deployment import Application, deployment_to_schema
from ray.serve.schema import ServeDeploySchema

from deployments.app import build_app
from deployments.args import AppArgs

ROOT = Path(__file__).resolve().parent.parent


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


# ------------------------------------------------------------------------------------ cluster.yaml


def test_cluster_yaml_passes_ray_up_validation():
    config = prepare_config(load("cluster.yaml"))  # what `ray up` does before validating
    validate_config(config)
    nodes = config["available_node_types"]
    head = nodes[config["head_node_type"]]
    assert head["resources"].get("GPU") == 0
    workers = [n for name, n in nodes.items() if name != config["head_node_type"]]
    assert workers and all(n["resources"]["GPU"] >= 1 for n in workers)
    assert any("ray start --head" in c for c in config["head_start_ray_commands"])
    assert any("ray start --address" in c for c in config["worker_start_ray_commands"])
    for setup in ("head_setup_commands", "worker_setup_commands"):
        assert any("pip install" in c and "dllm-serve" in c for c in config[setup]), setup


def test_ray_validator_rejects_a_misspelt_cluster_key():
    """The validator above is strict, so a typo in cluster.yaml is caught here and not by `ray up`."""
    config = prepare_config(load("cluster.yaml"))
    config["worker_start_commands"] = copy.deepcopy(config["worker_start_ray_commands"])
    with pytest.raises(jsonschema.ValidationError, match="worker_start_commands"):
        validate_config(config)


# ------------------------------------------------------------------------------- serve_config.yaml


@pytest.fixture(scope="module")
def serve_config() -> ServeDeploySchema:
    return ServeDeploySchema.model_validate(load("serve_config.yaml"))


def test_serve_config_passes_serve_schema(serve_config):
    assert serve_config.http_options.host == "0.0.0.0" and serve_config.http_options.port == 8000
    (app,) = serve_config.applications
    assert app.import_path == "deployments.app:build_app" and app.route_prefix == "/"


def test_serve_config_args_are_app_args(serve_config):
    args = serve_config.applications[0].args
    assert set(args) <= set(AppArgs.model_fields)
    parsed = AppArgs(**args)
    assert parsed.model is None  # the embedded tiny model unless the operator names a checkpoint
    for field in ("tensor_parallel_size", "dtype", "device", "max_num_seqs", "max_model_len", "max_queue",
                  "num_replicas", "mode", "policy", "threshold", "entropy_bound", "max_denoising_steps",
                  "max_body_bytes"):
        assert field in args, field


def test_serve_config_builds_the_application_without_ray(serve_config, tmp_path):
    """The same path `serve run serve_config.yaml` takes: import the builder, call it with the args."""
    from model.tiny import write_nemotron_ld

    app_config = serve_config.applications[0]
    args = {**app_config.args, "model": str(write_nemotron_ld(tmp_path / "tiny-nemotron-ld"))}
    app = call_user_app_builder_with_args_if_necessary(import_attr(app_config.import_path), args)
    assert isinstance(app, Application)
    built = serve_build_app(app, name=app_config.name)  # what Serve deploys: the finalized deployments
    deployments = {d.name: deployment_to_schema(d) for d in built.deployments}
    assert built.ingress_deployment_name == "OpenAIIngress" and set(deployments) == {"OpenAIIngress", "Coordinator"}
    coordinator, tp = deployments["Coordinator"], app_config.args["tensor_parallel_size"]
    assert coordinator.num_replicas == app_config.args["num_replicas"]
    assert len(coordinator.placement_group_bundles) == 1 + tp  # the replica's CPU bundle + one per shard
    assert not ray.is_initialized()


def test_autoscaling_config_reaches_the_coordinator_deployment(tiny_nemotron):
    scaling = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8, "upscale_delay_s": 5}
    built = serve_build_app(build_app({"model": str(tiny_nemotron), "autoscaling_config": scaling,
                                       "shard_cpus": 0.5, "drain_timeout_s": 7}), name="scaled")
    coordinator = deployment_to_schema(next(d for d in built.deployments if d.name == "Coordinator"))
    assert coordinator.autoscaling_config.max_replicas == 4 and not isinstance(coordinator.num_replicas, int)
    assert coordinator.autoscaling_config.target_ongoing_requests == 8
    assert coordinator.placement_group_bundles == [{"CPU": 1}, {"CPU": 0.5}]
    assert coordinator.graceful_shutdown_timeout_s == 7


def test_command_line_strings_are_coerced(tmp_path):
    """`serve run deployments.app:build_app model=DIR tensor_parallel_size=2` passes every value as a string."""
    from model.tiny import write_nemotron_ld

    model = write_nemotron_ld(tmp_path / "ckpt")
    app = build_app({"model": str(model), "tensor_parallel_size": "2", "max_denoising_steps": "8",
                     "threshold": "0.5"})
    assert isinstance(app, Application)
    assert AppArgs(tensor_parallel_size="2", threshold="0.5").tensor_parallel_size == 2


def test_the_default_denoising_steps_stay_within_the_limit():
    with pytest.raises(pydantic.ValidationError, match="denoising_steps_limit=1024"):
        AppArgs(max_denoising_steps=2000)
    assert AppArgs(max_denoising_steps=2000, denoising_steps_limit=4096).max_denoising_steps == 2000


def test_admission_steps_from_the_command_line_and_bounded():
    """`admission_steps=8` (a string from `serve run`) turns the scheduler's short commands off; 0 is no
    command at all: a deploy error naming it."""
    from workers.scheduler import ADMISSION_STEPS

    assert AppArgs().admission_steps == ADMISSION_STEPS and AppArgs(admission_steps="8").admission_steps == 8
    with pytest.raises(pydantic.ValidationError, match="admission_steps"):
        AppArgs(admission_steps=0)


def test_the_coordinator_takes_the_engine_arguments_build_app_passes():
    """build_app hands AppArgs.engine_args() to each replica's Coordinator: every key one of its
    parameters, each command-line value carried through."""
    import inspect

    from workers.coordinator import Coordinator

    args = AppArgs(max_num_seqs=3, max_queue=5, max_steps_per_command=16, overlap_commands=False, admission_steps=4,
                   request_timeout_s=30, max_model_len=1024).engine_args()
    bound = inspect.signature(Coordinator).bind(None, None, **args).arguments
    assert {k: bound[k] for k in args} == dict(num_slots=3, max_queue=5, max_steps_per_command=16,
                                               overlap_commands=False, admission_steps=4, request_timeout_s=30,
                                               max_model_len=1024, enable_prefix_caching=True, prefill_chunk=2048)


def test_quantization_argument_is_checked_against_the_checkpoint_at_deploy(tiny_nemotron, tmp_path):
    """vLLM's --quantization: unset or the checkpoint's own method builds; asking an unquantized checkpoint
    for compressed-tensors fails the deploy naming the argument."""
    from model.tiny import write_nemotron_ld

    fp8 = write_nemotron_ld(tmp_path / "fp8", quantize="fp8-dynamic")
    assert build_app({"model": str(fp8), "quantization": "compressed-tensors", "device": "cpu"}) is not None
    assert build_app({"model": str(tiny_nemotron), "device": "cpu"}) is not None
    with pytest.raises(ValueError, match=r"quantization='compressed-tensors'.*not quantized"):
        build_app({"model": str(tiny_nemotron), "quantization": "compressed-tensors", "device": "cpu"})
    with pytest.raises(pydantic.ValidationError, match="quantization"):
        AppArgs(quantization="awq")


def test_unknown_app_argument_is_a_pydantic_error_naming_it(tmp_path):
    with pytest.raises(pydantic.ValidationError) as info:
        build_app({"model": str(tmp_path), "tensor_paralel_size": 2})
    assert "tensor_paralel_size" in str(info.value)
    assert [e["type"] for e in info.value.errors()] == ["extra_forbidden"]


def test_bad_app_argument_value_names_the_field(tmp_path):
    with pytest.raises(pydantic.ValidationError, match="tensor_parallel_size"):
        build_app({"model": str(tmp_path), "tensor_parallel_size": 0})


def test_make_serve_arguments(monkeypatch):
    """`make serve MODEL=dir TP=n PORT=p ARGS="field=value"` -> scripts/serve_local.py's build_app args and port."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_local", ROOT / "scripts" / "serve_local.py")
    serve_local = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_local)
    assert serve_local.parse([], {"MODEL": "", "TP": "", "PORT": ""}) == ({}, 8000)  # `make serve`: the tiny model
    args, port = serve_local.parse(["tp=2", "max_num_seqs=4"], {"MODEL": "/ckpt", "TP": "1", "PORT": "8011"})
    assert (args, port) == ({"model": "/ckpt", "tensor_parallel_size": "2", "max_num_seqs": "4"}, 8011)
    assert AppArgs(**args).tensor_parallel_size == 2
    assert set(serve_local.ALIASES.values()) <= set(AppArgs.model_fields)
