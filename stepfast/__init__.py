"""stepfast: stepwise-credit GRPO for flow-matching image models."""

__version__ = "0.1.0"
