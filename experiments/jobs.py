"""The command line's options of a job, and the one place they become a :class:`cost_models.job.Job`.

A command's parser is generated from the option table (:mod:`experiments.options`) and the
command calls :func:`job_from_args` once; the job is then all that the
library sees (:func:`sim.simulate_job`, :func:`cost_models.bind.bind`,
:meth:`executor.RunConfig.from_job`). The job checks itself field by field (one line naming the
option, exit status 2); the options' types (:mod:`experiments.checks`) already refuse malformed
values while parsing.
"""
from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

from cost_models.job import ClusterChoice, Faults, Job, Layout, route_fields
from cost_models.parallel import Parallel, option_name
from schedules import families, get

from .options import fields_of

# the layout options' defaults, by dest: the records' own (chunks: for the families that take them, check_chunks)
SCHEDULE_DEFAULTS = {dest: next(f.default for f in fields(record) if f.name == name)
                     for dest, record, name in (("chunks", Layout, "chunks"), ("dp", Layout, "replicas"),
                                                ("tp", Parallel, "tp"))}
# What a --plan file fixes: these options describe the layout the planner chose (or the model and
# cluster it chose it for), so with a plan they are refused (check_plan_args), never dropped: (the
# option's dest, what it fixes). --tp-overlap and --cost-model are what-ifs a whole-layout plan takes
# (its job rebound with them); a plan without a tensor-parallel group, and a DAPPLE plan's layer
# costs, fix them (plan_facts names them only then). The other options of simulate / run are applied
# to the plan: --no-eager, --fabric / --oversubscription / --nodes-per-leaf and --memory-reserve (the
# plan's bind, planner.plan_io), the faults and --exact (sim.job_options), run's training options and
# run's --device-map (which torchrun process runs which of the plan's ranks, see cmd_run).
PLAN_FIXES = (
    ("schedule", "the schedule"), ("schedule_file", "the schedule"), ("devices", "the pipeline devices"),
    ("microbatches", "the micro-batches"),
    ("chunks", "the chunks"), ("variant", "the schedule's variant"), ("dp", "the data-parallel replicas"),
    ("tp", "tensor parallelism"), ("memory_limit", "the memory limit"), ("model", "the model"),
    ("seq_len", "the sequence length"), ("cluster", "the cluster"), ("nodes", "the cluster's size"),
    ("unit_costs", "the costs"), ("profile", "the costs and the layer partition"), ("stage_costs", "the costs"),
    ("profile_batch", "the costs"), ("micro_batch", "the micro-batch size"), ("partition", "the layer partition"),
    ("recompute", "recomputation"), ("zero", "ZeRO"), ("sequence_parallel", "sequence parallelism"),
    ("device_map", "the device map"), ("tp_overlap", "tensor parallelism"), ("cost_model", "the layer costs"),
)
# every knob of the parallel record is the plan's too: one not named above is fixed as itself
PLAN_FIXES += tuple((f.name, f"its {option_name(f.name)}") for f in fields(Parallel)
                    if f.name not in dict(PLAN_FIXES))


def check_plan_args(args, *, applied: tuple[str, ...] = ()):
    """For commands with ``--plan``: the plan file, loaded (None without ``--plan``). With a plan
    every option it fixes (:data:`PLAN_FIXES`, less the dests in ``applied``, which the command
    applies itself) is refused, one line naming the first given, the plan's value and every such
    option to drop; without one -s/-D/-N are required and --dp/--tp take their defaults (set on
    ``args``)."""
    plan = load_plan_arg(args)
    if plan is not None:
        o, facts = vars(args), plan_facts(plan)
        facts.setdefault("schedule_file", facts["schedule"])
        given = [(d, what) for d, what in PLAN_FIXES
                 if d in facts and d not in applied and o.get(d) is not None and o.get(d) is not False]
        if given:
            (dest, what), name = given[0], Path(args.plan).name
            drop = ", ".join(_flag(d) for d, _ in given)
            raise ValueError(f"{_flag(dest)}: the plan file fixes {what} ({facts[dest]} in {name}); "
                             f"drop {drop} or plan again")
        return plan
    missing = [f"--{d}" for d in ("schedule", "devices", "microbatches") if vars(args).get(d, 0) is None]
    if missing and not vars(args).get("schedule_file"):
        raise ValueError(f"give {', '.join(missing)} (or --plan PLAN.json), or a --schedule-file FILE")
    for dest in ("dp", "tp"):
        if vars(args).get(dest) is None:
            setattr(args, dest, SCHEDULE_DEFAULTS[dest])
    return None


def _flag(dest: str) -> str:
    return f"--{dest.replace('_', '-')}"


def plan_facts(plan) -> dict[str, str]:
    """What a loaded plan file fixes, by option dest (:data:`PLAN_FIXES`), as a short phrase with
    its value: a whole-layout plan (:class:`planner.plan_io.LayoutPlan`, a job) or a DAPPLE plan
    (:class:`planner.plan_io.LoadedPlan`)."""
    from cost_models.memory import fmt_bytes
    from planner.plan_io import LayoutPlan
    costs = f"{plan.model.name if isinstance(plan, LayoutPlan) else plan.workload.name} on {plan.cluster.name}"
    facts = {"cluster": f"cluster {plan.cluster.name}", "nodes": f"{plan.cluster.nodes} nodes",
             "unit_costs": costs, "profile": costs, "stage_costs": costs, "profile_batch": costs}
    if isinstance(plan, LayoutPlan):
        f, lay, par = plan.job_fields, plan.job_fields["layout"], plan.job_fields["parallel"]
        limit = lay.memory_limit
        facts.update(schedule=f"schedule {lay.schedule}", devices=f"D {lay.devices}",
                     microbatches=f"N {lay.microbatches}", chunks=f"chunks {lay.chunks}",
                     variant=f"variant {lay.variant or 'default'}", dp=f"R {lay.replicas}", tp=f"T {par.tp}",
                     memory_limit="memory limit " + ("none" if limit is None else f"{limit[0]:g} {limit[1]}"),
                     model=f"model {plan.model.name}", seq_len=f"sequence length {plan.model.seq_len}",
                     micro_batch=f"micro-batch {par.micro_batch}", partition="the default split",
                     recompute=f"recompute {par.recompute}", zero=f"zero {par.zero}",
                     sequence_parallel="sequence parallel " + ("on" if par.sequence_parallel else "off"),
                     device_map=f"device map {f['device_map']}")
        if par.tp == 1:
            facts["tp_overlap"] = "T 1"
        return _parallel_facts(plan, facts, takes=("tp_overlap",))
    p, src, spec = plan.plan, plan.workload.source, plan.workload.spec
    facts.update(schedule=f"schedule {p.schedule}", devices=f"{p.num_stages} stages",
                 microbatches=f"M {p.microbatches}", chunks=f"chunks {p.chunks}", variant="the schedule's default",
                 dp=f"R {p.dp}" if p.uniform else "stage replicas " + ":".join(map(str, p.replicas)),
                 tp="T 1", memory_limit="memory limit " + ("the device's" if plan.memory_limit is None else
                                                           fmt_bytes(plan.memory_limit)),
                 model=f"model {plan.workload.name}", micro_batch=f"micro-batch {p.micro_batch}",
                 partition="layers " + "|".join(map(str, p.schedule_partition)),
                 recompute=f"recompute {src.get('recompute', 'none')}", zero="zero 0",
                 sequence_parallel="sequence parallel off", device_map="the planner's placement",
                 tp_overlap="T 1", cost_model=f"cost model {src.get('cost_model', 'linear')}")
    facts["seq_len"] = f"sequence length {spec.seq_len}" if spec is not None else facts["model"]
    return _parallel_facts(plan, facts)


def _parallel_facts(plan, facts: dict[str, str], takes: tuple[str, ...] = ()) -> dict[str, str]:
    """``facts`` with every knob of the plan's parallel record not phrased above, as ``--knob value``
    (``takes``: the what-ifs the plan applies instead, unless phrased above)."""
    for f in fields(Parallel):
        if f.name not in takes:
            facts.setdefault(f.name, f"{option_name(f.name)} {getattr(plan.parallel, f.name)}")
    return facts


def chunked() -> list[str]:
    """The schedule families whose ``chunks`` per device matter (the registry's ``takes_chunks``)."""
    return [n for n, f in families().items() if f.takes_chunks]


def check_chunks(chunks: int | None, schedules) -> None:
    """``--chunks`` given (not None) for ``schedules`` of which none takes chunks: refused, since it
    would change nothing."""
    if chunks is not None and not any(get(n).takes_chunks for n in schedules):
        raise ValueError(f"--chunks applies to {', '.join(chunked())} only; {', '.join(schedules)} "
                         f"{'has' if len(schedules) == 1 else 'have'} no chunks (drop --chunks)")


# ---------------------------------------------------------------------- options -> job
def parse_partition(text: str | None):
    """``--partition``: None, ``"time"`` or a tuple of layer counts."""
    if text is None:
        return None
    if text.strip() == "time":
        return "time"
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--partition takes layer counts per stage (e.g. 3,2,2,3) or 'time'; got {text!r}") from None
    if any(c < 0 for c in counts):
        raise ValueError(f"--partition: layer counts must be >= 0; got {text!r}")
    return counts


def cluster_from_args(args) -> ClusterChoice:
    """The cluster options (the table's ``ClusterChoice`` rows: --cluster, --nodes, --fabric, ...)
    as a :class:`ClusterChoice`."""
    return ClusterChoice(**fields_of(args, "ClusterChoice"))


def layout_from_args(args, *, schedules=None, **overrides) -> Layout:
    """The layout options as a :class:`Layout` (``overrides``: its fields, for the commands whose
    options give a list where the layout has one value: ``compare``'s schedules, a sweep's axes;
    ``schedules``: the names a ``--chunks`` applies to, default the layout's one)."""
    o = vars(args)
    sf = schedule_file_arg(args)
    if sf is not None and "schedule" not in overrides:
        return file_layout(args, sf)
    given = fields_of(args, "Layout")
    given.pop("schedule_file", None)
    fields = {**dict(schedule=None, devices=None, microbatches=None, replicas=SCHEDULE_DEFAULTS["dp"],
                     chunks=SCHEDULE_DEFAULTS["chunks"], variant=None, memory_limit=None), **given}
    if sf is not None:      # compare: the named schedules at the file's D and N unless given
        fields.update(devices=fields["devices"] or sf.schedule.num_devices,
                      microbatches=fields["microbatches"] or sf.schedule.num_microbatches)
    fields.update(overrides)
    missing = [f for f, d in (("--devices", "devices"), ("--microbatches", "microbatches")) if fields[d] is None]
    if missing:
        raise ValueError(f"give {', '.join(missing)} (or a --schedule-file FILE)")
    layout = Layout(**fields)
    check_chunks(o.get("chunks"), schedules or [layout.schedule])
    return layout


def schedule_file_arg(args):
    """The ``--schedule-file``, read and validated once (:func:`cost_models.files.load_schedule_file`),
    or None."""
    path = vars(args).get("schedule_file")
    if not path:
        return None
    if vars(args).get("_schedule_file") is None:
        from cost_models.files import load_schedule_file
        args._schedule_file = load_schedule_file(path)
    return args._schedule_file


def file_layout(args, sf, *, chunks: bool = True) -> Layout:
    """The layout of schedule file ``sf``: -D/-N (and ``chunks``: --chunks) given must agree with
    it, --dp and --tp apply; with --schedule too, refused."""
    o = vars(args)
    if o.get("schedule"):
        raise ValueError(f"give --schedule or --schedule-file, not both (the file {Path(sf.path).name} is the "
                         f"schedule)")
    given = {k: o.get(dest) for k, dest in (("devices", "devices"), ("microbatches", "microbatches"),
                                            ("variant", "variant"), ("memory_limit", "memory_limit"))}
    if chunks:
        given["chunks"] = o.get("chunks")
    return Layout.of_file(sf, replicas=o.get("dp") or SCHEDULE_DEFAULTS["dp"],
                          **{k: v for k, v in given.items() if v is not None})


def job_from_args(args, *, layout: Layout | None = None, plan=None, **overrides) -> Job:
    """The one job the options of a command describe: its layout (``layout``, else from the layout
    options; none with ``plan``, a loaded plan file), its cost source, parallelism and faults, read
    through the option table (:func:`experiments.options.fields_of`: the rows the command took as
    scalars; a row it lacks leaves the record's default). ``overrides``: flat job fields the command
    sets itself (:func:`cost_models.job.route_fields`)."""
    fields: dict = {"plan": plan}
    if plan is None:
        fields["layout"] = layout if layout is not None else layout_from_args(args)
    own = fields_of(args, "Job")
    own.pop("plan", None)       # the path; the loaded plan is ``plan``
    if "partition" in own:
        own["partition"] = parse_partition(own["partition"])
    fields.update(own, cluster=cluster_from_args(args), faults=Faults(**fields_of(args, "Faults")))
    par = fields_of(args, "Parallel")
    layout_over, par_over, own_over = route_fields(overrides)
    if layout_over:
        fields["layout"] = replace(fields["layout"], **layout_over)
    if plan is not None:     # the plan's record, with the what-if it takes (the options it fixes were refused)
        par = {**plan.parallel.record(), **({"tp_overlap": True} if par.get("tp_overlap") else {})}
    fields["parallel"] = Parallel(**{**par, **par_over})
    fields.update(own_over)
    return Job(**fields)


def load_plan_arg(args):
    """The ``--plan`` file, loaded (the planner's reader), or None."""
    if not vars(args).get("plan"):
        return None
    from planner.plan_io import load_plan
    return load_plan(args.plan)


# ---------------------------------------------------------------------- another framework's file -> options
IMPORT_FLAGS = (("--from-megatron", "from_megatron"), ("--from-torchtitan", "from_torchtitan"))
# the imported job's flat fields (cost_models.frameworks.Imported.fields) -> the option rows they fill
_IMPORT_ROWS = {"replicas": "dp", "eager": "no_eager"}
_imported: list = []        # the notes of this process's import (print_json adds them to a --json record)


def import_notes() -> dict | None:
    """The current command's import notes (:meth:`cost_models.frameworks.Imported.notes`), or None."""
    return _imported[-1] if _imported else None


def _given(args, key: str) -> bool:
    """Whether the option of row ``key`` was given (its value is not the command's default)."""
    from .options import COMMANDS, row
    o = vars(args)
    opt = row(key)
    v = o.get(opt.name)
    use = next((u for u in COMMANDS.get(o.get("command"), ()) if u.key == key), None)
    default = opt.default if use is None or use.default is ... else use.default
    return v is not None and v is not False and v != default and v != [] and v != ()


def apply_framework_file(args) -> None:
    """``--from-megatron FILE`` / ``--from-torchtitan FILE``: the file's job
    (:func:`cost_models.frameworks.read_megatron`, :func:`~cost_models.frameworks.read_torchtitan`)
    fills the options the command takes and the user did not give (the options given override the
    file's); ``plan`` takes the model, sequence, global batch and GPU budget (it searches the rest).
    What changes the cost but is not modelled, and what no row reads, is one line each on standard
    error (and ``imported`` in a --json record)."""
    import sys
    from cost_models.files import read_text
    from cost_models.frameworks import read_megatron, read_torchtitan
    from .options import grammar_of, SCALAR
    _imported.clear()
    o = vars(args)
    command = o.get("command")
    given_files = [(flag, o[dest]) for flag, dest in IMPORT_FLAGS if o.get(dest)]
    if not given_files:
        if command == "sweep" and (o.get("devices") is None or o.get("microbatches") is None):
            raise ValueError("give --devices and --microbatches (or --from-megatron / --from-torchtitan FILE)")
        return
    if len(given_files) > 1:
        raise ValueError("give --from-megatron or --from-torchtitan, not both (each brings a whole job)")
    flag, path = given_files[0]
    if o.get("plan"):
        raise ValueError(f"{flag} and --plan both bring a job; give one")
    if o.get("schedule_file") and flag == "--from-megatron":
        raise ValueError("--from-megatron brings Megatron-LM's schedule; drop --schedule-file (or simulate the file "
                         "with --schedule-file alone)")
    dp = o.get("dp") if _given(args, "dp") else None
    if isinstance(dp, tuple):
        dp = dp[0]
    text = read_text(path, f"{flag} file")
    if flag == "--from-megatron":
        if _given(args, "model"):
            raise ValueError("--from-megatron brings the model (its --num-layers, --hidden-size, ...); drop --model")
        imp = read_megatron(text, path, replicas=dp)
    else:
        if not _given(args, "model") and command != "plan":
            raise ValueError("--from-torchtitan: torchtitan's model is its --module/--config recipe, not an override; "
                             "give --model (a preset, YAML or config.json)")
        if command == "plan" and o.get("model") is None:
            raise ValueError("--from-torchtitan: torchtitan's model is its --module/--config recipe; give --model")
        imp = read_torchtitan(text, path, o["model"], replicas=dp)
    fields = dict(imp.fields)
    left = []
    if command == "plan":
        spec = fields["model"]
        if o.get("model") is None or flag == "--from-megatron":
            args.model = spec
        if o.get("seq_len") is None and flag == "--from-torchtitan":
            args.seq_len = fields.get("seq_len")
        if o.get("global_batch") is None and o.get("global_tokens") is None:
            args.global_batch = imp.global_batch
        if o.get("gpus") is None:
            p = fields
            args.gpus = p.get("tp", 1) * p.get("cp", 1) * p["devices"] * p["replicas"]
    else:
        sf = fields.pop("schedule_file", None)
        if sf is not None and not o.get("schedule_file"):
            args.schedule_file, args._schedule_file = sf.path, sf
            fields.pop("schedule", None)
            fields.pop("chunks", None)
        if _given(args, "schedule") and fields.get("schedule") != o.get("schedule"):
            fields.pop("chunks", None)      # the file's chunks and variant are its schedule's, not the one given
            fields.pop("variant", None)
        for k, v in fields.items():
            key = _IMPORT_ROWS.get(k, k)
            grammar = grammar_of(args, key)
            if key == "schedule" and grammar_of(args, "schedules") is not None:
                continue        # compare and sweep run the file's schedule among their --schedules
            if grammar is None:
                from dataclasses import fields as fields_of_record
                defaults = {f.name: f.default for r in (Layout, Parallel, Job) for f in fields_of_record(r)}
                if k in defaults and v != defaults[k] and v is not None:
                    left.append(f"{k} {v}")
                continue
            if _given(args, key):
                continue
            from .options import row
            opt = row(key)
            if k == "partition":
                v = None if v is None else ",".join(map(str, v))
            if opt.invert:
                v = not v
            if v is None:
                continue
            setattr(args, opt.name, v if grammar == SCALAR else (v,))
    notes = imp.notes()
    if left:
        notes["not_applied"] = left
    _imported.append(notes)
    for what, items in (("not modelled", imp.unmodelled), ("ignored", imp.ignored),
                        (f"not taken by {command}", left)):
        if items:
            print(f"pipetwin: {flag} {path}: {what}: {', '.join(items)}", file=sys.stderr)
