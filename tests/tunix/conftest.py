from __future__ import annotations


def pytest_configure(config) -> None:
    # tunix 0.1.7 reads flax variables with the deprecated ``.value`` on every forward: one
    # warning per call, thousands per run, none about this project.
    config.addinivalue_line("filterwarnings", "ignore:'.value' access is now deprecated")
