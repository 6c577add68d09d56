"""Server processes: one process's lifecycle, and the live server each worker keeps."""
