"""Names of a model's attention modules ("sites") and the `model.pruned_heads` entries that
refer to them: "SITE:HEAD" with SITE encoder.<i>.self_attn, decoder.<i>.self_attn or
decoder.<i>.cross_attn and HEAD an original head index. Pure functions of the config, so
config validation, build_model and inspect-heads share one reading."""

from __future__ import annotations


def attention_sites(cfg) -> list[str]:
    """The attention modules a ModelConfig describes, in model order."""
    if cfg.arch == "lstm":
        return []
    sites = [f"encoder.{i}.self_attn" for i in range(cfg.n_encoder_layers)]
    if cfg.arch == "seq2seq":
        for i in range(cfg.n_decoder_layers):
            sites += [f"decoder.{i}.self_attn", f"decoder.{i}.cross_attn"]
    return sites


def heads_by_site(entries: list[str]) -> dict[str, list[int]]:
    """"SITE:HEAD" entries grouped: site -> sorted head indices (entries assumed valid)."""
    out: dict[str, list[int]] = {}
    for entry in entries:
        site, head = entry.rsplit(":", 1)
        out.setdefault(site, []).append(int(head))
    return {site: sorted(heads) for site, heads in out.items()}


def pruned_heads_problems(cfg) -> list[str]:
    """One line per malformed or impossible model.pruned_heads entry."""
    sites, out = set(attention_sites(cfg)), []
    for entry in cfg.pruned_heads:
        site, _, head = entry.rpartition(":")
        if site not in sites or not head.isdigit() or int(head) >= cfg.n_heads:
            out.append(f"model.pruned_heads: expected SITE:HEAD with SITE one of this model's attention "
                       f"modules (e.g. encoder.0.self_attn) and HEAD below {cfg.n_heads}, found {entry!r}")
    if not out:
        for site, heads in heads_by_site(cfg.pruned_heads).items():
            if len(set(heads)) != len(heads) or len(heads) >= cfg.n_heads:
                out.append(f"model.pruned_heads: {site} must keep at least one head and name each "
                           f"once, found {heads}")
    return out
