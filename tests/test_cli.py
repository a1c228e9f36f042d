"""The folio command line, in-process, on the tiny model."""
import io

from folio.cli import main


def tiny_args(tiny_llama_dir, default_model_path):
    return ["--set", f"model.path={tiny_llama_dir}", "--set",
            f"model.tokenizer={default_model_path}", "--set", "model.dtype=float32",
            "--set", "model.max_model_len=128", "--set", "memory.num_blocks=64",
            "--set", "observability.log_level=warning"]


def test_generate_prints_completion(tiny_llama_dir, default_model_path, capsys):
    rc = main(["generate", "Hello", "--max-tokens", "5"] + tiny_args(tiny_llama_dir,
                                                                      default_model_path))
    out, err = capsys.readouterr()
    assert rc == 0 and out.strip() and "5 tokens" in err


def test_chat_reads_turns_until_empty_line(tiny_llama_dir, default_model_path, capsys,
                                           monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi there\nAnd again\n\n"))
    rc = main(["chat", "--max-tokens", "4"] + tiny_args(tiny_llama_dir, default_model_path))
    out, _ = capsys.readouterr()
    assert rc == 0 and out.count("assistant>") == 2


def test_bad_config_key_exits_2_with_the_key(capsys):
    rc = main(["generate", "x", "--set", "scheduler.max_num_seq=4"])
    assert rc == 2 and "scheduler.max_num_seq" in capsys.readouterr().err


def test_config_command_lists_docs(capsys):
    assert main(["config", "--set", "scheduler.max_num_seqs=7"]) == 0
    out = capsys.readouterr().out
    assert "max_num_seqs:" in out and "7" in out and "token budget" in out


def test_config_resolved_prints_the_tree_as_yaml_with_secrets_redacted(capsys):
    import yaml
    assert main(["config", "--resolved", "--set", "scheduler.max_num_seqs=7",
                 "--set", "api.api_keys=[sk-secret-key]"]) == 0
    out = capsys.readouterr().out
    tree = yaml.safe_load(out)
    assert tree["scheduler"]["max_num_seqs"] == 7
    assert tree["api"]["api_keys"] == "<redacted>" and "sk-secret-key" not in out
