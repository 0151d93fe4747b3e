"""sbx: self-hosted, machine-like sandboxes for background AI agents."""

__version__ = "0.1.0"
