"""Benchmarks (`kvjax bench decode|prefix|peer|spec`) and the GPU device check: scripts that
warm up, take medians and compare side by side in one run."""


def bench_model(args) -> tuple[dict, object, str]:
    """(params, config, name) of a benchmark's `--model`: "random" is the `--config` file's
    model with random weights (seed 0), else a registry model (default SmolLM2)."""
    if args.model == "random":
        from kvjax.config_files import load_config
        from kvjax.model.transformer import init_params

        config = load_config(args.config).model
        return init_params(config, seed=0), config, "random"
    from kvjax import models

    name = args.model or "smollm2-135m-instruct"
    model = models.load(name)
    return model.params, model.config, name
