//! Chat prompts: an optional system instruction plus the question.
//!
//! QeRL's reference code (NVlabs/QeRL `utils/data.py`, `eval/gsm8k.py`) asks for the reasoning in
//! `<think>…</think>` and the answer in `<answer>…</answer>`; its GSM8K *training* prompt sends
//! the bare question as the user message (the system prompt is commented out there), its GSM8K
//! *evaluation* prompt adds the instruction as a system message. [`PromptTemplate::think_answer`]
//! gives an instruction of the same shape in our own words; [`PromptTemplate::bare`] the bare
//! question. The chat template itself (ChatML for Qwen2.5) is applied by the tokenizer side.

use serde::{Deserialize, Serialize};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn system(content: impl Into<String>) -> Self {
        Self {
            role: "system".into(),
            content: content.into(),
        }
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self {
            role: "user".into(),
            content: content.into(),
        }
    }
}

/// The instruction for the `<think>` / `<answer>` format that [`crate::reward::FormatReward::think_answer`]
/// checks and [`crate::reward::Gsm8kReward::strict`] reads.
pub const THINK_ANSWER_SYSTEM_PROMPT: &str = "Work through the math problem one step at a time. \
Put all of your reasoning between <think> and </think>, then put only the final answer between \
<answer> and </answer>, in this layout:\n<think>\n(reasoning)\n</think>\n<answer>\n(final answer)\n</answer>";

/// The instruction for a final answer in `\boxed{…}` (MATH-style graders read the last box).
pub const BOXED_SYSTEM_PROMPT: &str =
    "Work through the math problem one step at a time, then write the final answer as \\boxed{answer}.";

/// Placeholder replaced by the question in [`PromptTemplate::user`].
pub const QUESTION_PLACEHOLDER: &str = "{question}";

/// How to turn a question into chat messages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptTemplate {
    /// System message, if any.
    #[serde(default)]
    pub system: Option<String>,
    /// User message; `{question}` is replaced by the question (the whole question when absent).
    #[serde(default = "default_user")]
    pub user: String,
}

fn default_user() -> String {
    QUESTION_PLACEHOLDER.to_string()
}

impl Default for PromptTemplate {
    fn default() -> Self {
        Self::think_answer()
    }
}

impl PromptTemplate {
    /// System instruction for `<think>`/`<answer>` + the question (QeRL's eval prompt shape).
    pub fn think_answer() -> Self {
        Self {
            system: Some(THINK_ANSWER_SYSTEM_PROMPT.into()),
            user: default_user(),
        }
    }

    /// System instruction for a `\boxed{}` answer + the question.
    pub fn boxed() -> Self {
        Self {
            system: Some(BOXED_SYSTEM_PROMPT.into()),
            user: default_user(),
        }
    }

    /// The bare question as the only (user) message (QeRL's GSM8K training prompt shape).
    pub fn bare() -> Self {
        Self {
            system: None,
            user: default_user(),
        }
    }

    /// The chat messages for one question.
    pub fn render(&self, question: &str) -> Vec<ChatMessage> {
        let mut out = Vec::with_capacity(2);
        if let Some(s) = self.system.as_deref().filter(|s| !s.is_empty()) {
            out.push(ChatMessage::system(s));
        }
        let user = if self.user.contains(QUESTION_PLACEHOLDER) {
            self.user.replace(QUESTION_PLACEHOLDER, question)
        } else if self.user.is_empty() {
            question.to_string()
        } else {
            format!("{}\n\n{}", self.user, question)
        };
        out.push(ChatMessage::user(user));
        out
    }
}
