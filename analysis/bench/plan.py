"""placeholder until the freeze-planner bench lands."""


def add_arguments(parser):
    pass


def run(args, out_dir):
    raise NotImplementedError
