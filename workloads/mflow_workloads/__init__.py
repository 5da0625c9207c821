"""Python workloads that mflow launches: training, evaluation, export verification, doctor."""

__version__ = "0.1.0"
