"""The executor's choices as plain data, without torch: what a run's options may be, offered by
the command line's option table (:mod:`experiments.options`) and checked by the run
(:class:`executor.config.RunConfig`, :mod:`executor.precision`, :func:`executor.device.check_device`)."""

OPTIMIZERS = ("adam", "sgd")         # sgd: momentum 0.9
DTYPES = ("fp32", "bf16", "fp8")     # bf16: autocast with fp32 master weights; fp8: + fp8 linear layers (GPU)
DEVICES = ("auto", "cpu", "cuda")    # auto: cuda where available
