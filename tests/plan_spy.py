"""Which kernels the launch plans chose: shared by tests in several folders (tests/ is on sys.path,
tests/conftest.py), so that none depends on another folder's test module being imported first."""
from dualattn.kernels.flash import plan as flash_plan


def _spy(monkeypatch, plan_name: str, record) -> list:
    """record(head launch) of every plan flash_plan.<plan_name> gives from then on: the forward's launch, or the
    backward's dK/dV launch."""
    seen, real = [], getattr(flash_plan, plan_name)

    def spy(*args, **kwargs):
        planned = real(*args, **kwargs)
        seen.append(record(planned.dkdv if plan_name == "plan_backward" else planned))
        return planned

    monkeypatch.setattr(flash_plan, plan_name, spy)
    return seen


def spy_kernels(monkeypatch, plan_name="plan_backward") -> list:
    """The kernel names of every launch flash_plan.<plan_name> gives from then on (the backward's
    dK/dV launch, or the forward launch)."""
    return _spy(monkeypatch, plan_name, lambda launch: launch.kernel)


def spy_chains(monkeypatch, plan_name="plan_forward") -> list:
    """Every launch chain flash_plan.<plan_name> gives from then on, as its kernel names (the forward's
    chain, or the backward's dK/dV chain)."""
    return _spy(monkeypatch, plan_name, lambda head: [launch.kernel for launch in head.chain])


def spy_launches(monkeypatch, plan_name="plan_forward") -> list:
    """Every launch flash_plan.<plan_name> gives from then on (the forward's, or the backward's dK/dV launch):
    for tests that check a launch's constexprs, not only its kernel."""
    return _spy(monkeypatch, plan_name, lambda launch: launch)
