"""selfrl: continual self-improvement of LLM agents by online reinforcement learning."""

__version__ = "0.1.0"
