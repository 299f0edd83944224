"""Importers turn real agent logs (AgentCgroup runs, mini-swe-agent trajectories) into traces."""

from tenon.replay.importers.agentcgroup import import_agentcgroup
from tenon.replay.importers.miniswe import MemoryProfile, import_mini_swe_agent, load_memory_profile

__all__ = ["MemoryProfile", "import_agentcgroup", "import_mini_swe_agent", "load_memory_profile"]
