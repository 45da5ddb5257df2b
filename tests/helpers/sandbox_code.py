"""Cell code the sandbox tests share."""

# Fills a sandbox's memory to within 1 MB and keeps it in the global ``chunks``. Big chunks:
# calloc maps them without touching a page (the limit is on address space), so this costs
# little of a test cell's 2 s of CPU time, which faulting in hundreds of MB of pages can
# take on a loaded host. Add a loop of small allocations to fill the rest.
FILL_MEMORY = (
    "chunks = []\n"
    "try:\n"
    "    while True:\n"
    "        chunks.append(bytes(1 << 20))\n"
    "except MemoryError:\n"
    "    pass\n"
)
