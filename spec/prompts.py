"""The prompts the experiments run on."""

# The seed notebook's five prompts, verbatim.
SEED_PROMPTS = [
    "The key difference between supervised and unsupervised learning is",
    "In a surprising discovery announced on Tuesday, scientists reported that",
    "The recipe for a perfect chocolate chip cookie starts with",
    "def binary_search(arr, target):",
    "The economic history of the late Roman Empire shows that",
]
# The shipped pair is trained on Python source (the standard library), so it gets code to continue;
# the first is the seed's own code prompt. The random stand-in pair uses these too.
CODE_PROMPTS = [
    "def binary_search(arr, target):\n",
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
    "import os\nimport sys\n\n\ndef main(argv=None):\n",
    "def read_lines(path):\n    with open(path, encoding=\"utf-8\") as f:\n",
    "    def __repr__(self):\n        return",
]
