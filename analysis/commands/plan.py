"""`pipeplan plan`: placeholder registered until the freeze planner lands."""



def add_arguments(parser):
    pass


def run(args):
    raise NotImplementedError
