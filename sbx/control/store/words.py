"""Word lists for sandbox subdomains (``adjective-adjective-animal``, e.g. ``calm-bright-otter``).

Written for sbx; all words are lowercase ASCII letters so the result is a valid DNS label.
"""

ADJECTIVES = [
    "able", "agile", "amber", "ample", "azure", "bold", "brave", "brisk", "bright", "busy",
    "calm", "clever", "cosy", "crisp", "curly", "daring", "dapper", "eager", "early", "easy",
    "fair", "fancy", "fast", "fluffy", "fond", "free", "fresh", "gentle", "glad", "golden",
    "grand", "happy", "hardy", "honest", "humble", "jolly", "keen", "kind", "lively", "lucky",
    "mellow", "merry", "mighty", "misty", "modest", "neat", "nimble", "noble", "plucky", "polite",
    "proud", "quick", "quiet", "rapid", "regal", "rosy", "rustic", "shiny", "silent", "simple",
    "smooth", "snowy", "solid", "spry", "steady", "sunny", "swift", "tidy", "warm", "witty",
]

ANIMALS = [
    "alpaca", "badger", "beaver", "bison", "bobcat", "camel", "cheetah", "cobra", "condor", "cougar",
    "coyote", "crane", "cricket", "dingo", "dolphin", "donkey", "eagle", "egret", "falcon", "ferret",
    "finch", "gecko", "gibbon", "gopher", "heron", "hippo", "ibex", "iguana", "jackal", "jaguar",
    "koala", "lemur", "llama", "lynx", "magpie", "marmot", "mole", "moose", "newt", "ocelot",
    "orca", "osprey", "otter", "panda", "parrot", "pelican", "puffin", "quail", "rabbit", "raven",
    "salmon", "seal", "sparrow", "stork", "tapir", "tiger", "toucan", "turtle", "walrus", "wombat",
    "yak", "zebra",
]
