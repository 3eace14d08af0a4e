"""The setting groups that core owns: cluster, engine, training, checkpoint and logging.

Groups owned by a component live next to it (data: `miles.rollout.data_source`, rollout:
`miles.rollout.rollout_config`, reward: `miles.rollout.rewards`, algorithm: training-utils'
`LossConfig`, eval: `miles.config.eval_config`) and the backend's group comes from its wheel. Each
group checks its own fields; checks across groups live in `miles.config.cross_checks`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config import engine_addresses


def _at_least(value: int | float | None, minimum: int | float, flag: str) -> None:
    if value is not None and value < minimum:
        raise ValueError(f"{flag} must be >= {minimum}, got {value}")


@dataclass(kw_only=True)
class ClusterConfig:
    """Where processes run. On a machine without GPUs, every "GPU" below counts worker devices
    (one process and one CPU slot each), so the same flags place a run on a laptop."""

    actor_num_nodes: int = 1
    """Nodes of the training group."""
    actor_num_gpus_per_node: int = 1
    """Training ranks per node (GPUs; worker devices on CPU)."""
    rollout_num_gpus: int | None = None
    """Devices of all rollout engines together; default: the training devices with --colocate,
    else --rollout-num-gpus-per-engine (one engine)."""
    rollout_num_gpus_per_engine: int = 1
    """Devices of one engine (its tensor-parallel size)."""
    colocate: bool = False
    """Trainers and engines share the same devices, taking turns (sleep / wake-up)."""
    cpus_per_bundle: float = 1.0
    """CPUs reserved with each device (with GPUs: for the device's process and its data work;
    without: the worker slot itself)."""
    ray_address: str | None = None
    """Join this Ray cluster (also read from $RAY_ADDRESS) instead of starting a local one."""
    train_backend: str = "fsdp"
    """Training backend, from an installed wheel: fsdp (miles-fsdp) or megatron (miles-megatron)."""
    rollout_engine: Literal["auto", "sglang", "reference"] = "auto"
    """Inference engine: sglang (GPUs), reference (pure PyTorch, any device); auto picks sglang
    when it is installed and GPUs are present, else reference."""
    rollout_external_engine_addrs: list[str] | None = None
    """Engines this run does not launch (host:port each: your SGLang servers, or reference
    engines started by hand): it generates on them and pushes its weights into them, reserves no
    devices for them and leaves them running at the end; a lost one is not restarted. Each must
    answer and serve --hf-checkpoint at start. Not with --colocate, --rollout-num-gpus or engine
    launch flags."""

    def __post_init__(self) -> None:
        _at_least(self.actor_num_nodes, 1, "--actor-num-nodes")
        _at_least(self.actor_num_gpus_per_node, 1, "--actor-num-gpus-per-node")
        _at_least(self.rollout_num_gpus, 1, "--rollout-num-gpus")
        _at_least(self.rollout_num_gpus_per_engine, 1, "--rollout-num-gpus-per-engine")
        engine_addresses.check_cluster(
            self.rollout_external_engine_addrs,
            colocate=self.colocate,
            rollout_num_gpus=self.rollout_num_gpus,
            rollout_num_gpus_per_engine=self.rollout_num_gpus_per_engine,
            rollout_engine=self.rollout_engine,
        )

    @property
    def external_engine_urls(self) -> list[str]:
        """The base URLs of --rollout-external-engine-addrs (none: the run launches its own)."""
        return [engine_addresses.engine_url(a) for a in self.rollout_external_engine_addrs or []]

    @property
    def actor_world_size(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node


@dataclass(kw_only=True)
class EngineConfig:
    """How rollout engines are started and fronted."""

    rollout_router: Literal["auto", "sglang-router", "builtin"] = "auto"
    """What spreads requests over several engines: sglang-router (when installed; auto picks it
    then) or miles's built-in least-loaded balancer."""
    engine_max_running_requests: int | None = None
    """Sequences one engine decodes together (SGLang --max-running-requests); None: the
    engine's default."""
    engine_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weight dtype in the engines; auto: the checkpoint's."""
    engine_mem_fraction_static: float | None = None
    """SGLang only: fraction of GPU memory for weights and KV cache."""
    engine_startup_timeout_s: float = 600.0
    """How long to wait for every engine to answer /health after launch (external engines:
    /health_generate at start)."""
    engine_log_dir: str | None = None
    """Write each engine's output to a file here (default: the run's output directory)."""
    use_fault_tolerance: bool | None = None
    """Health-check the engines and restart a dead or hung one: its requests go to the others
    (a group whole), and it rejoins with the current weights; an external engine is left out
    for good instead. None: on unless the engines are colocated (one engine included);
    --no-use-fault-tolerance turns it off."""
    max_engine_restarts: int = 3
    """Restarts allowed per engine before the run stops (with fault tolerance)."""
    rollout_health_check_interval_s: float = 5.0
    """Seconds between two health checks of an engine (with fault tolerance)."""
    rollout_health_check_timeout_s: float = 30.0
    """An engine whose /health does not answer within this many seconds counts as hung."""
    rollout_request_timeout_s: float = 3600.0
    """The longest wait for one /generate answer (or for an engine to serve again after a
    failure); past it the rollout fails naming the engine."""
    engine_control_timeout_s: float = 60.0
    """The longest wait for an engine's answer to a control call (pause, abort, flush, info)."""
    update_weights_timeout_s: float = 1800.0
    """The longest wait for an engine's answer to one weight-update or memory call."""
    rollout_manager_timeout_s: float = 600.0
    """The longest the driver waits for the rollout manager to answer a call, beyond the engine
    waits the call makes (each bounded by its own flag). While a rollout runs, the driver asks
    every second whether the manager is alive, within this bound. Past it the run stops,
    naming the manager's process."""
    rollout_request_timeout_per_token_s: float | None = 1.0
    """A /generate answer's deadline: this times the request's max_new_tokens plus
    --engine-control-timeout-s, capped at --rollout-request-timeout-s, so a hung engine fails a
    short request in a minute, not an hour. none: --rollout-request-timeout-s for every request."""
    sglang_server_args: list[str] | None = None
    """Further SGLang server flags as key=value (or key for a switch), passed through verbatim;
    on the command line also as `--sglang-<flag> [value]` (e.g. --sglang-context-length 8192).
    An error with the reference engine."""

    def __post_init__(self) -> None:
        _at_least(self.engine_max_running_requests, 1, "--engine-max-running-requests")
        frac = self.engine_mem_fraction_static
        if frac is not None and not 0 < frac <= 1:
            raise ValueError(f"--engine-mem-fraction-static must be in (0, 1], got {frac}")
        if self.engine_startup_timeout_s <= 0:
            raise ValueError(
                f"--engine-startup-timeout-s must be positive, got "
                f"{self.engine_startup_timeout_s}; give the seconds to wait for the engines' "
                "/health, e.g. 600"
            )
        _at_least(self.max_engine_restarts, 0, "--max-engine-restarts")
        for flag, seconds in (
            ("--rollout-health-check-interval-s", self.rollout_health_check_interval_s),
            ("--rollout-health-check-timeout-s", self.rollout_health_check_timeout_s),
            ("--rollout-request-timeout-s", self.rollout_request_timeout_s),
            ("--engine-control-timeout-s", self.engine_control_timeout_s),
            ("--update-weights-timeout-s", self.update_weights_timeout_s),
            ("--rollout-manager-timeout-s", self.rollout_manager_timeout_s),
            ("--rollout-request-timeout-per-token-s",
             self.rollout_request_timeout_per_token_s or 1.0),
        ):  # fmt: skip
            if not seconds > 0:
                raise ValueError(f"{flag} must be a positive number of seconds, got {seconds}")
        for item in self.sglang_server_args or []:
            key = item.partition("=")[0]
            if not key or key.startswith("-"):
                raise ValueError(
                    f"--sglang-server-args takes key=value (or key) items without dashes, e.g. "
                    f"context-length=8192; got {item!r}"
                )

    @property
    def sglang_extra_args(self) -> dict[str, str | bool | list[str]]:
        """The items as SGLang flag values: a switch is True, "a b" a list of values."""
        extra: dict[str, str | bool | list[str]] = {}
        for item in self.sglang_server_args or []:
            key, sep, value = item.partition("=")
            extra[key] = True if not sep else value.split() if " " in value else value
        return extra


@dataclass(kw_only=True)
class TrainingConfig:
    """How much to train per rollout and for how long."""

    global_batch_size: int | None = None
    """Samples per optimizer step; derived from --num-steps-per-rollout when not given."""
    num_steps_per_rollout: int | None = None
    """Optimizer steps per rollout; derived from --global-batch-size when not given (both
    unset: one step per rollout)."""
    num_rollout: int | None = None
    """Rollouts (RL iterations) to run; or give --num-epoch."""
    num_epoch: int | None = None
    """Passes over --prompt-data; sets --num-rollout from the dataset size."""
    async_train: bool = False
    """Overlap generation of the next rollout with training (one step off-policy); needs
    --off-policy-correction and separate devices (no --colocate). Also spelled --async."""
    fully_async: bool = False
    """Generation never waits for training: engines fill a bounded buffer in the background and
    each train step takes the oldest ready groups within --max-weight-staleness; needs
    --off-policy-correction and separate devices (no --colocate)."""
    max_weight_staleness: int = 1
    """--fully-async: the most weight versions a trained sample's weights may lag the engines'
    current ones (0: only samples of the current weights)."""
    async_unused_samples_handler: Literal["drop", "keep"] = "drop"
    """--fully-async: a group past --max-weight-staleness is dropped, or (keep) its prompt goes
    back to the data source to be generated again with newer weights."""
    fully_async_buffer_groups: int | None = None
    """--fully-async: groups ready or generating at once; default --rollout-batch-size x
    --max-weight-staleness (at least one batch): the groups the next steps can still train on
    (the step in progress holds its own), so none is generated only to be dropped."""
    update_weights_interval: int = 1
    """Push the trained weights to the engines every this many rollouts (and after the last);
    above 1 the engines generate with older weights, so it needs --off-policy-correction."""
    use_rollout_routing_replay: bool = False
    """MoE routing replay R3: the engines report each token's experts (return_routed_experts)
    and every trainer forward routes the tokens to exactly those; the gates are recomputed from
    the router's logits, so the router still learns."""
    use_routing_replay: bool = False
    """MoE routing replay R2: the optimizer steps of a rollout route each token as the
    old-policy forward did (needs a loss that computes old log-probs)."""
    debug_rollout_only: bool = False
    """Generate and score rollouts without training (engines only)."""
    debug_train_only: bool = False
    """Train on rollouts saved by --save-debug-rollout-data instead of generating."""
    save_debug_rollout_data: str | None = None
    """Save each rollout's train data to this path pattern (with `{rollout_id}`)."""
    load_debug_rollout_data: str | None = None
    """Read rollouts from this path pattern (with `{rollout_id}`) for --debug-train-only."""
    check_weight_sync_tolerance: float | None = 0.1
    """Step-0 check: the largest allowed mean |trainer - engine| log-prob gap after the first
    weight update; None skips the check."""
    max_consecutive_nonfinite_steps: int = 3
    """Stop the run after this many optimizer steps in a row with a non-finite gradient norm
    (each is skipped, leaving weights and optimizer state as they were)."""
    collapse_window: int = 5
    """Warn when the policy looks collapsed (entropy back near ln(vocabulary), gradient norm exactly 0,
    or every reward at the lowest seen) for this many rollouts in a row."""
    abort_on_collapse: bool = False
    """Stop the run on collapse instead of warning."""
    distributed_timeout_s: float = 1800.0
    """The longest a train rank waits in a collective for its peers; past it the rank fails and
    the run stops, naming the ranks that did not answer."""
    train_call_timeout_s: float = 3600.0
    """The longest the driver waits for every train rank to answer one call (start-up, a
    rollout's train steps, a weight update, a save); past it the run stops naming the ranks that
    did not answer. It finds a rank hung outside any collective, so it must exceed
    --distributed-timeout-s (a rank hung inside one is named by its peers first)."""
    max_train_restarts: int = 3
    """How often the run starts its train group again after a train rank died or hung: the new
    group loads the last checkpoint and replays the rollouts trained since (their train data is
    kept in <save>/train_data until a checkpoint covers it), then the run goes on exactly as
    before. Past this many restarts the run stops, naming the last failure. Needs --save and
    --save-interval (the disk holds at most that many rollouts' train data); off with --colocate
    and with a critic on ranks of its own. 0: a failed rank stops the run."""
    stop_grace_s: float = 60.0
    """After SIGTERM or SIGINT, how long `miles train` has to finish the step in progress and save
    its checkpoint before it stops at once, without one (the latest checkpoint stays intact).
    A second signal stops at once too. It exits with 128 + the signal's number (143, 130)."""

    def __post_init__(self) -> None:
        _at_least(self.global_batch_size, 1, "--global-batch-size")
        _at_least(self.max_consecutive_nonfinite_steps, 1, "--max-consecutive-nonfinite-steps")
        _at_least(self.collapse_window, 1, "--collapse-window")
        if not self.distributed_timeout_s > 0:
            raise ValueError(
                f"--distributed-timeout-s must be a positive number of seconds, got "
                f"{self.distributed_timeout_s}"
            )
        if not self.train_call_timeout_s > self.distributed_timeout_s:
            raise ValueError(
                f"--train-call-timeout-s ({self.train_call_timeout_s}) must exceed "
                f"--distributed-timeout-s ({self.distributed_timeout_s}): a rank hung in a "
                "collective is named by its peers once the latter passes; raise the former"
            )
        _at_least(self.max_train_restarts, 0, "--max-train-restarts")
        if not self.stop_grace_s > 0:
            raise ValueError(f"--stop-grace-s ({self.stop_grace_s}) must be positive")
        _at_least(self.num_steps_per_rollout, 1, "--num-steps-per-rollout")
        _at_least(self.max_weight_staleness, 0, "--max-weight-staleness")
        _at_least(self.fully_async_buffer_groups, 1, "--fully-async-buffer-groups")
        _at_least(self.update_weights_interval, 1, "--update-weights-interval")
        if self.use_rollout_routing_replay and self.use_routing_replay:
            raise ValueError(
                "--use-rollout-routing-replay (the engine's experts) and --use-routing-replay "
                "(the old-policy forward's) are two sources of replayed routing; pick one"
            )
        if self.fully_async and self.async_train:
            raise ValueError(
                "--fully-async and --async-train are two ways to overlap generation with "
                "training; pick one (--fully-async generates continuously, --async-train one "
                "rollout ahead)"
            )
        if self.fully_async and (self.debug_rollout_only or self.debug_train_only):
            raise ValueError(
                "--fully-async overlaps generation with training; --debug-rollout-only and "
                "--debug-train-only each run only one of them: drop one of the flags"
            )
        _at_least(self.num_rollout, 1, "--num-rollout")
        _at_least(self.num_epoch, 1, "--num-epoch")
        if self.num_rollout is not None and self.num_epoch is not None:
            raise ValueError(
                f"--num-rollout ({self.num_rollout}) and --num-epoch ({self.num_epoch}) both set "
                "the run's length; give one of them"
            )
        if self.debug_rollout_only and self.debug_train_only:
            raise ValueError(
                "--debug-rollout-only and --debug-train-only exclude each other; pick one"
            )
        if self.debug_train_only and not self.load_debug_rollout_data:
            raise ValueError(
                "--debug-train-only trains on saved rollouts: set --load-debug-rollout-data to "
                "the --save-debug-rollout-data pattern of an earlier run"
            )
        if self.load_debug_rollout_data and not self.debug_train_only:
            raise ValueError(
                "--load-debug-rollout-data is only read with --debug-train-only; add that flag "
                "or drop this one"
            )
        for flag, pattern in (
            ("--save-debug-rollout-data", self.save_debug_rollout_data),
            ("--load-debug-rollout-data", self.load_debug_rollout_data),
        ):
            if pattern is not None and "{rollout_id}" not in pattern:
                raise ValueError(
                    f"{flag} {pattern!r} needs a {{rollout_id}} placeholder, e.g. "
                    "'runs/debug/rollout_{rollout_id}.pt', so rollouts do not overwrite each other"
                )
        tol = self.check_weight_sync_tolerance
        if tol is not None and tol <= 0:
            raise ValueError(
                f"--check-weight-sync-tolerance must be positive, got {tol}; pass none to skip"
            )


@dataclass(kw_only=True)
class CheckpointConfig:
    """What to load at start and what to save."""

    hf_checkpoint: str
    """Hugging Face checkpoint directory of the initial policy (weights, config, tokenizer)."""
    save: str | None = None
    """Directory for resumable checkpoints (`iter_<N>/` and a `latest` pointer)."""
    save_interval: int | None = None
    """Save every this many rollouts (and after the last); needs --save."""
    load: str | None = None
    """Resume from the latest checkpoint in this directory (default: --save, if it has one)."""
    ref_load: str | None = None
    """Hugging Face checkpoint directory of the reference model (--kl-coef, --use-kl-loss);
    default: --hf-checkpoint."""
    ref_update_interval: int | None = None
    """Every this many rollouts, set the reference model's weights to the current policy's
    (an exact copy); default: the reference model never changes."""

    def __post_init__(self) -> None:
        if not self.hf_checkpoint:
            raise ValueError("--hf-checkpoint is empty; pass a Hugging Face checkpoint directory")
        _at_least(self.save_interval, 1, "--save-interval")
        _at_least(self.ref_update_interval, 1, "--ref-update-interval")
        if self.save_interval is not None and not self.save:
            raise ValueError(
                f"--save-interval {self.save_interval} has nowhere to write: set --save DIR"
            )


@dataclass(kw_only=True)
class LoggingConfig:
    """Where metrics go."""

    output_dir: str = "runs/miles"
    """Run directory: metrics.jsonl, TensorBoard events, plots and engine logs."""
    overwrite_output_dir: bool = False
    """Let a fresh run use an --output-dir that holds another run's metrics (refused otherwise);
    the old metrics.jsonl is kept beside the new one as metrics.replaced-<time>.jsonl."""
    use_tensorboard: bool = False
    """Also write TensorBoard events (needs `miles[tensorboard]`)."""
    use_wandb: bool = False
    """Also log to Weights & Biases (needs `miles[wandb]`)."""
    wandb_project: str = "miles"
    """W&B project."""
    wandb_mode: Literal["online", "offline"] = "offline"
    """W&B mode; offline writes under the run directory and needs no network (`wandb sync` later)."""
    wandb_run_name: str | None = None
    """W&B run name; default: W&B's."""
    console: Literal["auto", "rich", "plain"] = "auto"
    """Live console view: rich (a status panel), plain (one log line per rollout), auto: rich
    on a terminal."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Python logging level of miles's loggers."""
