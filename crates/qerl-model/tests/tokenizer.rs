//! tokenizer.json through the `tokenizers` crate (fancy-regex backend) against the Python
//! library's ids, and the ChatML template.

mod common;

use std::path::Path;

use qerl_model::{ChatTemplate, Message, ModelError, Tokenizer};
use serde_json::Value;

fn qwen() -> Tokenizer {
    Tokenizer::from_file(&common::repo().join("tests/fixtures/tokenizers/qwen2.5/tokenizer.json"))
        .unwrap()
}

fn reference() -> Value {
    serde_json::from_slice(
        &std::fs::read(common::parity_dir().join("tokenizer_qwen2.5.json")).unwrap(),
    )
    .unwrap()
}

#[test]
fn qwen_ids_match_the_python_tokenizers_library() {
    let tok = qwen();
    assert_eq!(tok.vocab_size(), 151665);
    for case in reference()["qwen2.5"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(ids, common::ids(&case["ids"]), "{text:?}");
        assert_eq!(
            tok.decode_ids(&ids, false).unwrap(),
            case["decoded"].as_str().unwrap()
        );
    }
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(151645));
    assert_eq!(tok.id_to_token(151644).as_deref(), Some("<|im_start|>"));
}

#[test]
fn chatml_renders_and_tokenizes_like_the_reference() {
    let tok = qwen();
    let cases = reference();
    let expected = &cases["qwen2.5"].as_array().unwrap()[4];
    let messages = [
        Message::new("system", "You are a helpful assistant."),
        Message::new("user", "What is 2+2?"),
    ];
    let template = ChatTemplate::default();
    assert_eq!(
        template.render(&messages, true),
        expected["text"].as_str().unwrap()
    );
    assert_eq!(
        template.encode(&tok, &messages, true).unwrap(),
        common::ids(&expected["ids"])
    );
    // without a generation prompt, and a multi-turn conversation
    let turns = [
        Message::new("user", "Hi"),
        Message::new("assistant", "Hello!"),
        Message::new("user", "Bye"),
    ];
    assert_eq!(
        template.render(&turns, false),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
    );
}

#[test]
fn default_system_message_of_a_chatml_template() {
    // The opening of Qwen2.5's chat_template (tokenizer_config.json), as Jinja source.
    let qwen25 = "{%- if tools %}...{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n        \
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n        \
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n    \
        {%- endif %}\n{%- endif %}";
    let t = ChatTemplate::from_template(qwen25, Path::new("tokenizer_config.json")).unwrap();
    assert_eq!(
        t.default_system.as_deref(),
        Some("You are Qwen, created by Alibaba Cloud. You are a helpful assistant.")
    );
    let text = t.render(&[Message::new("user", "Hi")], true);
    assert!(text.starts_with("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud."));
    assert!(text.ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"));
    // an explicit system message replaces the default
    let text = t.render(
        &[Message::new("system", "S"), Message::new("user", "Hi")],
        false,
    );
    assert!(text.starts_with("<|im_start|>system\nS<|im_end|>\n") && !text.contains("Qwen"));

    // a template whose system text is not a literal: no default
    let plain = "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n'}}{% endfor %}";
    assert_eq!(
        ChatTemplate::from_template(plain, Path::new("t"))
            .unwrap()
            .default_system,
        None
    );

    // Llama 3's template is not ChatML
    let llama3 = "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}";
    let e = ChatTemplate::from_template(llama3, Path::new("/m/tokenizer_config.json")).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("/m/tokenizer_config.json")
            && msg.contains("chat_template")
            && msg.contains("ChatML"),
        "{msg}"
    );

    // read from a model directory
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(
        tmp.path().join("tokenizer_config.json"),
        serde_json::to_vec(&serde_json::json!({ "chat_template": qwen25 })).unwrap(),
    )
    .unwrap();
    assert_eq!(ChatTemplate::for_model(tmp.path()).unwrap(), t);
}

#[test]
fn tiny_tokenizer_and_missing_files() {
    let tiny =
        Tokenizer::from_file(&common::repo().join("tests/fixtures/tokenizers/tiny/tokenizer.json"))
            .unwrap();
    assert!(tiny.vocab_size() <= 512);
    assert_eq!(tiny.token_to_id("<|im_end|>"), Some(2));
    for case in reference()["tiny"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let ids = tiny.encode(text, true).unwrap();
        assert_eq!(ids, common::ids(&case["ids"]));
        assert_eq!(tiny.decode_ids(&ids, false).unwrap(), text);
    }
    // a model directory without tokenizer.json
    let dir = common::repo().join("tests/fixtures/compressed-tensors/llama_untied/bf16");
    let e = Tokenizer::for_model(&dir, None).unwrap_err();
    assert!(matches!(e, ModelError::NoTokenizer { .. }));
    assert!(e.to_string().contains("--tokenizer"), "{e}");
    let e = Tokenizer::from_file(Path::new("/nonexistent/tokenizer.json")).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/tokenizer.json"), "{e}");
    // ChatML on a tokenizer without the markers
    let gpt2ish = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(
        common::repo().join("tests/fixtures/tokenizers/tiny/tokenizer.json"),
    )
    .unwrap();
    let stripped = text.replace("<|im_start|>", "<|xx_start|>");
    std::fs::write(gpt2ish.path().join("tokenizer.json"), stripped).unwrap();
    let tok = Tokenizer::for_model(gpt2ish.path(), None).unwrap();
    let e = ChatTemplate::default()
        .encode(&tok, &[Message::new("user", "hi")], true)
        .unwrap_err();
    assert!(e.to_string().contains("<|im_start|>"), "{e}");
}
