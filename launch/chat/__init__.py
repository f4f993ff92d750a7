"""Chat text: chat templates, DeepSeek-V3.2's encoding, reasoning and tool-call parsers (no HTTP here)."""
