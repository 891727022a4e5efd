"""The agent: one per host; starts, watches and signals that host's processes."""

from checkpointless.agent.agent import Agent, AgentConfig, ProcessHandle, ProcExit, ProcVerdict

__all__ = ["Agent", "AgentConfig", "ProcExit", "ProcVerdict", "ProcessHandle"]
