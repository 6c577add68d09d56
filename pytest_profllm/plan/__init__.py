"""The plan stage: suite files and markers (`suite`) expanded into cases (`case`)."""
