"""The sentences: every word a report says, written from its typed facts (causes, notes, tensor names,
operands, the headline). Imports nothing of the views above it (text, table, HTML, widget, plots)."""
