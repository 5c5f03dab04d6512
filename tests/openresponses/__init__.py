"""The Open Responses compliance suite, ported (SOURCE.md), and the schema it checks."""
