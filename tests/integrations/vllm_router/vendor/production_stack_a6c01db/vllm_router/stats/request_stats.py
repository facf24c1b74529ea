# Not production-stack's: a stand-in (the type routing_logic imports).


class RequestStats:
    pass
