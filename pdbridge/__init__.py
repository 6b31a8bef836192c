"""pdbridge: operations platform for cross-datacenter prefill/decode disaggregated inference."""

__version__ = "0.1.0"
