"""Optional dependencies. The core (LLM(...).generate, `pipellm generate`/`chat`) needs none of them; each feature
that does checks for its extra first and, when a package is missing, raises one error that names the extra."""
import importlib.util

EXTRAS = {
    "serve": ("fastapi", "pydantic", "uvicorn", "prometheus_client"),  # pipellm serve, its /metrics
    "plot": ("matplotlib",),                                            # trace and inspect pictures
}


class MissingExtraError(ImportError):
    pass


def require_extra(extra: str, feature: str) -> None:
    """Raises MissingExtraError, e.g. "pipellm serve needs the serve extra (fastapi is not installed):
    pip install 'pipellm[serve]'", unless every package of the extra can be imported."""
    missing = [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(f"{feature} needs the {extra} extra ({', '.join(missing)} "
                                f"{'is' if len(missing) == 1 else 'are'} not installed): pip install 'pipellm[{extra}]'")


def pyplot(feature: str):
    """matplotlib.pyplot on the file-only Agg backend, once the plot extra is there."""
    require_extra("plot", feature)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
