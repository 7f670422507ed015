"""What shapes a response's text: structured outputs (JSON schema, regex, grammars) and tool calls."""
