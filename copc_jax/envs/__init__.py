"""Tasks and their tools: the code sandbox, math with a code interpreter, search."""
